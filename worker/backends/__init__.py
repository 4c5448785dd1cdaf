"""Model backends: the :class:`~tokenq.worker.backends.base.Backend` protocol and its kinds.

``sim``, ``hf`` and ``package.module:factory`` plugins, chosen by
:func:`~tokenq.worker.backends.plugins.load_backend` from the
:mod:`~tokenq.worker.backends.registry`. Backends import only ``shared`` and this
package (``tests/project/test_architecture.py``), so the chunk windows they share
with the pipeline live here (:mod:`~tokenq.worker.backends.chunks`).
"""
