"""The request pipeline both batching loops call: entries, jobs, batch outcomes, answers.

No Redis or asyncio I/O, so each policy is written once for ``worker/loop/worker.py`` and
``worker/local``: :mod:`.pipeline` (the rules), :mod:`.execute` (one batch,
failures isolated), :mod:`.finisher` (options on results), :mod:`.jobs` (stream
entries in, answers out). Chunk windows: :mod:`tokenq.worker.backends.chunks`.
"""
