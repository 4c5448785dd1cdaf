"""Child processes restarted when they fail and dying with their parent: ``PR_SET_PDEATHSIG`` on
Linux (it fires when the forking *thread* exits: start them from the main thread), else a guard."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal

from tokenq.shared.exit_codes import EXIT_OK, EXIT_USAGE, MEANINGS

log = logging.getLogger("tokenq.worker")

_POLL_S = 0.1
_REPEAT_S = 1.0  # a second stop signal within this time is the same stop, not a kill
_KILL_WAIT_S = 10.0
_GUARD_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def describe_exit(code: int | None) -> str:  # exit code 3 (its meaning), signal SIGKILL, ...
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    meaning = MEANINGS.get(code)
    return f"exit code {code}" + (f" ({meaning})" if meaning else "")


def shell_status(code: int) -> int:  # a signal N is 128 + N
    return code if code >= 0 else 128 - code


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again: the wait starts at ``initial_s`` and doubles
    up to ``max_s``, a child that ran ``reset_after_s`` starts over; ``final_codes`` never."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0
    final_codes: frozenset[int] = frozenset({EXIT_OK, EXIT_USAGE})

    def delay(self, code: int, ran_s: float, previous_s: float | None) -> float | None:
        """Seconds to wait before restarting (None: do not); ``previous_s``: the last delay."""
        if code in self.final_codes:
            return None
        if previous_s is None or ran_s >= self.reset_after_s:
            return self.initial_s
        return min(previous_s * 2, self.max_s)


def _load_prctl() -> Any:
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None


def prctl(option: int, value: int) -> bool:
    """Linux ``prctl(option, value)``; False where there is none or it fails."""
    return _PRCTL is not None and _PRCTL(option, value, 0, 0, 0) == 0


def _pdeathsig_preexec(parent: int) -> None:
    """In the child between fork and exec: SIGTERM me when ``parent`` dies."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above: too late to ask
        os._exit(1)


def die_with_parent(parent: int, *, use_prctl: bool = True) -> None:
    """In a child spawned by multiprocessing: SIGKILL it once ``parent`` has exited, by
    ``prctl`` on Linux, else a thread polling the parent."""
    if not (use_prctl and prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)):
        threading.Thread(target=_poll_parent, args=(parent,), daemon=True,
                         name="tokenq-parent-watch").start()
    if os.getppid() != parent:  # it died before the watch began: too late to be told
        os.kill(os.getpid(), signal.SIGKILL)


def _poll_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_GUARD_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def guarded(argv: Sequence[str]) -> list[str]:
    """``argv`` run under the guard that ends it when this process exits."""
    return [sys.executable, "-m", "tokenq.worker.tooling.children", str(os.getpid()), *argv]


def _guard_main(args: Sequence[str]) -> int:
    """``python -m tokenq.worker.tooling.children PARENT_PID COMMAND...``: run COMMAND, forward
    signals, exit as it does; SIGTERM it (SIGKILL 30 s later) once PARENT_PID is gone."""
    if len(args) < 2 or not args[0].isdigit():
        print("usage: python -m tokenq.worker.tooling.children PARENT_PID COMMAND...",
              file=sys.stderr)
        return EXIT_USAGE
    parent = int(args[0])
    pending: list[int] = []  # signals that came before the child existed
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        if child is None:
            pending.append(signum)
        else:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    child = subprocess.Popen(list(args[1:]))
    for signum in pending:
        child.send_signal(signum)
    orphaned_at: float | None = None
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = child.wait(timeout=_GUARD_POLL_S)
            break
        if orphaned_at is None and os.getppid() != parent:
            orphaned_at = time.monotonic()
            child.terminate()
        elif orphaned_at is not None and time.monotonic() - orphaned_at > 30.0:
            child.kill()
    if code < 0:  # die the way the child died, so the supervisor sees the same code
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return shell_status(code)  # a signal whose default is not to terminate
    return code


@dataclass
class Child:
    """One supervised command: its current process, and its restart history."""

    name: str
    argv: list[str]
    env: dict[str, str]
    restart: bool = True
    popen: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    returncode: int | None = None  # the last exit's (None while the first process runs)
    restarts: int = 0
    restart_at: float | None = None  # when the pending restart is due (monotonic)
    delay_s: float | None = None  # the delay before the last restart (the policy doubles it)
    finished: bool = False  # exited and will not be started again
    running: bool = False  # started, and its exit not yet seen by the supervisor

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def live(self) -> bool:  # running, or due to be restarted
        return self.running or self.restart_at is not None


class Supervisor:
    """Children restarted by a :class:`RestartPolicy`, stopped together, never orphaned. From
    the main thread, ``with Supervisor() as sup:``, then :meth:`start` and :meth:`run`; a first
    SIGTERM/SIGINT stops, a later second one SIGKILLs all."""

    def __init__(
        self, policy: RestartPolicy | None = None, *, stop_timeout_s: float = 30.0,
        poll_s: float = _POLL_S,
        die_with_parent: Literal["auto", "prctl", "guard", "none"] = "auto",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        if die_with_parent == "prctl" and _PRCTL is None:
            raise RuntimeError("prctl(PR_SET_PDEATHSIG) needs Linux")
        auto = "prctl" if _PRCTL is not None else "guard"
        self.death_mode = auto if die_with_parent == "auto" else die_with_parent
        self.clock = clock
        self.children: list[Child] = []
        self.stopping = False  # a stop was asked for: no more restarts; run returns
        self._signalled_at: float | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Supervisor:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], *,
        restart: bool = True, **popen: Any,
    ) -> Child:
        """Start ``argv`` as child ``name``; ``popen`` goes to :class:`subprocess.Popen`."""
        child = Child(name, list(argv), dict(env), restart=restart, popen=popen)
        self.children.append(child)
        self._spawn(child)
        log.info("started %s (pid %d)", name, child.pid)
        return child

    def _spawn(self, child: Child) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.debug("starting %s off the main thread: it dies when this thread does", child.name)
        argv, popen = child.argv, dict(child.popen)
        if self.death_mode == "prctl":
            popen["preexec_fn"] = functools.partial(_pdeathsig_preexec, os.getpid())
        elif self.death_mode == "guard":
            argv = guarded(argv)
        child.process = subprocess.Popen(argv, env=child.env, **popen)
        child.started_at = self.clock()
        child.running = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._signalled_at is None:
            self._signalled_at = now
            self.stopping = True
            names = ", ".join(child.name for child in self.children if child.running)
            log.info("signal %s: stopping %s", signal.Signals(signum).name, names or "(none)")
        elif now - self._signalled_at >= _REPEAT_S:  # sooner: the same stop sent to the
            log.warning("second signal: killing children")  # process group (timeout(1), a shell)
            self.kill()

    def poll(self) -> None:
        """Notice exits, schedule restarts, start those that are due."""
        now = self.clock()
        for child in self.children:
            process = child.process
            if process is not None and child.running and process.poll() is not None:
                self._on_exit(child, process, now)
            if child.restart_at is not None and now >= child.restart_at and not self.stopping:
                child.restart_at = None
                child.restarts += 1
                self._spawn(child)
                log.warning("restarted %s (pid %d; restart %d)", child.name, child.pid,
                            child.restarts)

    def _on_exit(self, child: Child, process: subprocess.Popen[bytes], now: float) -> None:
        code = child.returncode = process.returncode
        child.running = False
        ran = now - child.started_at
        what = (f"{child.name} (pid {process.pid}) exited with {describe_exit(code)} "
                f"after {ran:.1f}s")
        if self.stopping or child.finished:
            child.finished = True
            log.info("%s", what)
            return
        delay = self.policy.delay(code, ran, child.delay_s) if child.restart else None
        if delay is None:
            child.finished = True
            log.log(logging.INFO if code == 0 else logging.ERROR, "%s; not restarting", what)
            return
        child.delay_s = delay
        child.restart_at = now + delay
        log.warning("%s; restarting in %.1fs", what, delay)

    def run(self, until: Callable[[], object] | None = None) -> None:
        """Poll until a stop, ``until()``, or (without it) no child running or due to restart."""
        done = until or (lambda: not any(child.live for child in self.children))
        self._poll_until(lambda: self.stopping or done())

    def _poll_until(self, done: Callable[[], object], timeout: float | None = None) -> bool:
        """Poll until ``done()`` (True) or ``timeout`` passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            if done():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)

    def _send(self, sig: int, children: Iterable[Child]) -> None:
        for child in children:
            if child.running and child.process is not None:  # not reaped: still our pid
                with contextlib.suppress(ProcessLookupError):  # exited just now
                    child.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL every running child now (safe in a signal handler: no waiting)."""
        self.stopping = True
        for child in self.children:
            child.restart_at = None
        self._send(signal.SIGKILL, self.children)

    def stop(self, children: Sequence[Child] | None = None, timeout_s: float | None = None) -> None:
        """SIGTERM ``children`` (default all), wait the stop timeout, SIGKILL whoever is left;
        nothing is restarted after this."""
        self.stopping = True
        chosen = list(self.children if children is None else children)
        timeout = self.stop_timeout_s if timeout_s is None else timeout_s
        for child in chosen:
            child.finished = True
            child.restart_at = None
        self._send(signal.SIGTERM, chosen)

        def exited() -> bool:
            return not any(child.running for child in chosen)

        if not self._poll_until(exited, timeout):
            names = ", ".join(child.name for child in chosen if child.running)
            log.warning("still running after %gs: %s; killing", timeout, names)
            self._send(signal.SIGKILL, chosen)
            self._poll_until(exited, _KILL_WAIT_S)

    def exit_code(self) -> int:
        """The parent's exit status: 0 when every child ended cleanly, else the first failure's."""
        for child in self.children:
            code = child.returncode
            if code not in (None, 0, -signal.SIGTERM, -signal.SIGINT):
                return shell_status(code)
        return 0


if __name__ == "__main__":
    sys.exit(_guard_main(sys.argv[1:]))
