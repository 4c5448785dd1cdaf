"""Model backends: the :class:`~tokenq.worker.backends.base.Backend` protocol, ``sim``, ``hf``
and plugins. They import only ``shared`` and this package."""
