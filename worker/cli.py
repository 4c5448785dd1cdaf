"""``tokenq worker``: parse settings, load the backend, serve until a signal.

Exit codes (defined in :mod:`tokenq.worker.tooling.children`, whose supervisors act
on them; docs/OPERATIONS.md lists them):

* 0 — stopped cleanly (a signal, or ``--exit-when-idle-s``);
* 2 — bad settings or a model the settings cannot serve: restarting cannot help;
* 3 — a stage holding entries hung past its deadline (the watchdog: a batch
  on the device or a tokenizer past ``--batch-timeout-s``; the loop guard: an
  event loop stuck in a stage): restart the process, peers take its requests;
* 4 — the worker itself failed (the device was lost, an internal error):
  restart it; its requests are claimed by peers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from tokenq.shared.errors import ConfigError
from tokenq.shared.exit_codes import EXIT_FATAL, EXIT_HUNG, EXIT_OK, EXIT_USAGE
from tokenq.shared.flags import UsageError, parse_settings
from tokenq.worker import collector, endpoint, logs, metrics
from tokenq.worker.backends.plugins import load_backend
from tokenq.worker.health import Health
from tokenq.worker.loop import Worker, WorkerHung, watchdog_period_s
from tokenq.worker.settings import WorkerSettings, settings_class_for
from tokenq.worker.stages import Overdue
from tokenq.worker.tooling.supervise import run_per_device

log = logging.getLogger("tokenq.worker")

PROG = "tokenq worker"


async def serve(settings: WorkerSettings) -> None:
    """Open the endpoint, load the backend, run the worker until a signal.

    The endpoint comes first, so probes answer (``/readyz``: ``model
    loading``) while a model of gigabytes loads; it closes last.
    """
    health = Health(settings.heartbeat_s, watchdog_period_s(settings))
    worker_metrics = metrics.create(settings)
    served = endpoint.serve(settings.metrics_host, settings.metrics_port, health,
                            worker_metrics.wsgi_app())
    try:
        await _load_and_run(settings, health, worker_metrics)
    finally:
        if served is not None:
            served.close()


async def _load_and_run(
    settings: WorkerSettings, health: Health, worker_metrics: metrics.NullMetrics
) -> None:
    backend = await asyncio.to_thread(load_backend, settings)
    try:
        worker = Worker(settings, backend, metrics=worker_metrics, health=health,
                        on_stuck=_exit_stuck)
    except BaseException:
        backend.close()
        raise
    info = backend.info
    collector.settle_after_startup()  # the model and the worker are built: freeze them
    worker_metrics.describe(
        consumer=worker.consumer, model=info.model, backend=info.name, device=info.device
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        await worker.run()
    except WorkerHung as exc:
        # The hung batch's thread cannot be stopped, and interpreter shutdown
        # would wait for it forever: leave at once, as a crash would.
        _exit_hung(str(exc))
    finally:
        backend.close()


def _exit_stuck(late: Overdue) -> None:
    """The loop guard's way out: the event loop itself is stuck in ``late``'s stage."""
    _exit_hung(f"{late.stage.name} hung on the event loop: {late.reason}")


def _exit_hung(why: str) -> None:
    log.critical("exiting %d: %s", EXIT_HUNG, why)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_HUNG)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Like uvicorn: a plugin named as module:factory may live in the working directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        # The flags depend on the backend: a plugin's own settings join the class.
        settings = parse_settings(settings_class_for(args), args, PROG)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.log_level, json_lines=settings.logs_json)
    if settings.devices is not None:
        return run_per_device(settings, args)
    try:
        asyncio.run(serve(settings))
    except ConfigError as exc:
        log.error("%s", exc)
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        log.critical("worker failed, exiting %d: %s: %s", EXIT_FATAL, type(exc).__name__, exc,
                     exc_info=exc)
        return EXIT_FATAL
    return EXIT_OK

