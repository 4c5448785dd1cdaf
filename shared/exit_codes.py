"""Every exit status a tokenq command or worker process ends with, and what each means.

One home for the numbers: the dispatcher (``shared/cli.py``), the worker
(``worker/cli.py``), and the supervisors that restart workers and report
their exits (``worker/tooling/children.py``) all read them here, so a
supervisor never disagrees with the worker about which exit is final.
docs/OPERATIONS.md, "Exit status", documents them for operators.
"""

from __future__ import annotations

EXIT_OK = 0
"""Done; for a worker, a clean stop (SIGTERM, ``exit_when_idle_s``)."""
EXIT_FAILED = 1
"""An operational failure: Redis unreachable or refusing, ids not found, inputs failed."""
EXIT_USAGE = 2
"""Bad flags, environment or arguments: nothing was done, and restarting cannot help."""
EXIT_HUNG = 3
"""A stage holding entries hung past its deadline (the worker's watchdog: a batch on the
device, or a read being tokenized, past ``batch_timeout_s``; ``worker/stages.py``)."""
EXIT_FATAL = 4
"""The worker itself failed: the device was lost (a sticky CUDA error) or an internal error."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C): the shell's 128 + SIGINT."""

MEANINGS: dict[int, str] = {
    EXIT_OK: "clean stop",
    EXIT_FAILED: "error",
    EXIT_USAGE: "configuration or usage error",
    EXIT_HUNG: "a batch hung past batch_timeout_s",
    EXIT_FATAL: "fatal: the device was lost or an internal error",
}
"""The words a supervisor logs after a child's exit code (``describe_exit``)."""
