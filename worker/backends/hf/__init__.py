"""The Hugging Face backend: loading, tokenizing, pooling and running transformers models.

Importing this package imports torch; the worker does so only when
``--backend hf`` is chosen.
"""
