"""Model backends: the :class:`~tokenq.worker.backends.base.Backend` protocol and its kinds.

``sim`` (a simulated GPU), ``hf`` (transformers and sentence-transformers
models, its own subpackage) and plugins named ``package.module:factory``,
all chosen by :func:`~tokenq.worker.backends.plugins.load_backend`. Each
backend registers a ``BackendEntry`` (its name, its settings, its builder) in
:mod:`~tokenq.worker.backends.registry`; the worker's settings are composed
from those (:mod:`tokenq.worker.settings`).

Backends sit at the bottom of the worker: a module here imports ``shared`` and
``tokenq.worker.backends`` only (``tests/project/test_architecture.py``), so what a
backend shares with the pipeline, the chunk windows, lives here
(:mod:`~tokenq.worker.backends.chunks`) and the pipeline imports it downward.
"""
