"""One worker process's life: open the endpoint, load the backend, run the loop until a signal."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys

from tokenq.shared.exit_codes import EXIT_HUNG
from tokenq.worker import endpoint, metrics
from tokenq.worker.backends.plugins import load_backend
from tokenq.worker.health import Health
from tokenq.worker.loop.stages import Overdue
from tokenq.worker.loop.worker import Worker, WorkerHung, watchdog_period_s
from tokenq.worker.settings import WorkerSettings

log = logging.getLogger("tokenq.worker")

YOUNG_THRESHOLD = 10_000  # allocations between two young-generation collections, once running


async def serve(settings: WorkerSettings) -> None:
    """Open the endpoint, load the backend, run the worker until a signal; the endpoint
    opens first (``/readyz``: ``model loading``) and closes last."""
    health = Health(settings.heartbeat_s, watchdog_period_s(settings))
    worker_metrics = metrics.create(settings)
    close = endpoint.serve(settings.metrics_host, settings.metrics_port, health,
                           worker_metrics.wsgi_app())
    try:
        backend = await asyncio.to_thread(load_backend, settings)
        try:
            worker = Worker(settings, backend, metrics=worker_metrics, health=health,
                            on_stuck=_exit_stuck)
            settle_after_startup()  # the model and the worker are built: freeze them
            info = backend.info
            worker_metrics.describe(
                consumer=worker.consumer, model=info.model, backend=info.name, device=info.device
            )
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, worker.stop)
            await worker.run()
        except WorkerHung as exc:
            # The hung batch's thread cannot be stopped, and interpreter shutdown
            # would wait for it forever: leave at once, as a crash would.
            _exit_hung(str(exc))
        finally:
            backend.close()
    finally:
        if close is not None:
            close()


def _exit_stuck(late: Overdue) -> None:  # the event loop itself is stuck in late's stage
    _exit_hung(f"{late.stage.name} hung on the event loop: {late.reason}")


def _exit_hung(why: str) -> None:
    log.critical("exiting %d: %s", EXIT_HUNG, why)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_HUNG)


def settle_after_startup() -> None:
    """Collect startup's garbage, freeze what is left, and widen the youngest generation."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
