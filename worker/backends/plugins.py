"""Turn the ``backend`` setting (a registered name, or ``package.module:factory`` taking the
settings) into a Backend, or one :class:`ConfigError` naming the spec and why not."""

from __future__ import annotations

from typing import Any, cast

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.base import TASKS, Backend, BackendInfo
from tokenq.worker.backends.registry import by_name, resolve

_BACKEND_MEMBERS = ("info", "tokenize", "run", "close")


def load_backend(settings: Any) -> Backend:
    """Build the backend ``settings.backend`` names; ConfigError if it cannot."""
    spec = settings.backend.strip()
    try:  # a registered backend's builder is imported only when called (hf's pulls in torch)
        factory = by_name(spec) or resolve(spec)
    except ConfigError as exc:
        raise ConfigError(f"backend {spec!r}: {exc}") from exc.__cause__
    if not callable(factory):
        raise ConfigError(
            f"backend {spec!r}: {spec.partition(':')[2]!r} is a {type(factory).__name__}, not a "
            "callable factory(settings) -> Backend"
        )
    try:
        backend = factory(settings)
    except ConfigError as exc:
        raise ConfigError(f"backend {spec!r}: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"backend {spec!r}: the factory raised {type(exc).__name__}: {exc}"
        ) from exc
    problem = _problem(backend)
    if problem is not None:
        raise ConfigError(f"backend {spec!r}: {problem}")
    return cast(Backend, backend)


def _problem(backend: Any) -> str | None:
    """What makes a factory's result not a Backend, or None."""
    kind = type(backend).__name__
    missing = [name for name in _BACKEND_MEMBERS if not hasattr(backend, name)]
    if missing:
        return (
            f"the factory returned a {kind}, which lacks {', '.join(missing)} "
            "(see tokenq.worker.backends.base.Backend)"
        )
    not_callable = [name for name in _BACKEND_MEMBERS[1:] if not callable(getattr(backend, name))]
    if not_callable:
        return f"{', '.join(not_callable)} of the returned {kind} must be methods"
    info = backend.info
    if not isinstance(info, BackendInfo):
        return f"info must be a tokenq.worker.backends.base.BackendInfo, got {type(info).__name__}"
    if info.task not in TASKS:
        return f"info.task must be one of {', '.join(TASKS)}, got {info.task!r}"
    if info.max_input_tokens < 1:
        return f"info.max_input_tokens must be >= 1, got {info.max_input_tokens}"
    return None
