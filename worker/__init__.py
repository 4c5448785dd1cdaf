"""The tokenq worker: pull requests, pack by token budget, run a model, reply."""
