"""Model backends: the :class:`~tokenq.worker.backends.base.Backend` protocol and its kinds.

``sim`` (a simulated GPU), ``hf`` (transformers and sentence-transformers
models, its own subpackage) and plugins named ``package.module:factory``,
all chosen by :func:`~tokenq.worker.backends.plugins.load_backend`.
"""
