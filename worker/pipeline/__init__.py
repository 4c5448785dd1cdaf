"""The request pipeline both batching loops call: entries, jobs, batch outcomes, answers.

Nothing here does Redis or asyncio I/O. The Redis worker (``worker/loop.py``)
and the in-process batcher (``worker/local``) feed it and carry out what it
returns, so a policy (over-length, deadlines, OOM splitting, chunking) is
written once and both honour it:

* :mod:`.pipeline` requests → jobs → batch outcomes (the rules);
* :mod:`.execute` one batch on the device, failures isolated;
* :mod:`.finisher` what options and model defaults do to a result;
* :mod:`.jobs` the Redis side: stream entries in, dead letters, answer bytes out.

The windows of an over-long input and their combination are
:mod:`tokenq.worker.backends.chunks`, below the backends that cut them.
"""
