"""Processes around the worker: the supervisor, ``tokenq up`` and the embedded Redis."""
