"""The tokenq worker: pull requests, pack by token budget, run a model, reply.

Needs the ``worker`` extra (numpy, torch, transformers) for real models; the
simulated backend needs only numpy.
"""
