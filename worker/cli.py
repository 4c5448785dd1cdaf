"""``tokenq worker``: parse settings, then run one worker process (:mod:`.process`) or one per GPU.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from tokenq.shared.cli import report_missing_extra
from tokenq.shared.errors import ConfigError
from tokenq.shared.exit_codes import EXIT_FATAL, EXIT_OK, EXIT_USAGE
from tokenq.shared.flags import UsageError, parse_settings
from tokenq.worker import logs
from tokenq.worker.settings import settings_class_for

log = logging.getLogger("tokenq.worker")

PROG = "tokenq worker"


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
    try:
        # Past --help and the settings: the worker extra is needed from here on,
        # also under --devices (before any child starts).
        from tokenq.worker import process
    except ModuleNotFoundError as exc:
        return report_missing_extra(PROG, exc)
    if settings.devices is not None:
        from tokenq.worker.tooling.supervise import run_per_device

        return run_per_device(settings, args)
    try:
        asyncio.run(process.serve(settings))
    except ConfigError as exc:
        log.error("%s", exc)
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        log.critical("worker failed, exiting %d: %s: %s", EXIT_FATAL, type(exc).__name__, exc,
                     exc_info=exc)
        return EXIT_FATAL
    return EXIT_OK

