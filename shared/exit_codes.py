"""Every exit status of a tokenq command or worker (docs/OPERATIONS.md, "Exit status"): one home,
so a supervisor never disagrees with the worker."""

from __future__ import annotations

EXIT_OK = 0
"""Done; for a worker, a clean stop (SIGTERM, ``exit_when_idle_s``)."""
EXIT_FAILED = 1
"""An operational failure: Redis unreachable or refusing, ids not found, inputs failed."""
EXIT_USAGE = 2
"""Bad flags, environment or arguments: nothing was done, and restarting cannot help."""
EXIT_HUNG = 3
"""A stage holding entries hung past ``batch_timeout_s`` (the worker's watchdog)."""
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
