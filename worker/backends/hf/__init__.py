"""The Hugging Face backend; the worker imports it (and torch) only for ``--backend hf``."""
