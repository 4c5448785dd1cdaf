"""In-process batching: the worker's pipeline and packer without Redis in between."""

from tokenq.worker.local.batcher import Batcher, BatcherOptions, BatcherStats

__all__ = ["Batcher", "BatcherOptions", "BatcherStats"]
