"""In-process batching: the worker's pipeline and packer without Redis in between."""
