"""The tokenq worker: pull requests, pack by token budget, run a model, reply.

Real models need the ``worker`` extra; the simulated backend needs only numpy.
"""
