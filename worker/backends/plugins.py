"""Turn the ``backend`` setting (a registered name, or ``package.module:factory`` taking the
settings) into a Backend, or one :class:`ConfigError` naming the spec and why not.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any, cast

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.base import TASKS, Backend, BackendInfo
from tokenq.worker.backends.registry import BackendEntry, by_name, registered

_BACKEND_MEMBERS = ("info", "tokenize", "run", "close")
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_PLUGIN_SPEC = re.compile(
    rf"^(?P<module>{_IDENTIFIER}(?:\.{_IDENTIFIER})*)"
    rf":(?P<attr>{_IDENTIFIER}(?:\.{_IDENTIFIER})*)$"
)


def load_backend(settings: Any) -> Backend:
    """Build the backend ``settings.backend`` names; ConfigError if it cannot."""
    spec = settings.backend.strip()
    entry = by_name(spec)
    factory = _plugin_factory(spec) if entry is None else _builder(entry)
    return _checked(_call(factory, settings, spec), spec)


def _builder(entry: BackendEntry) -> Callable[[Any], Any]:
    """A registered backend's builder, imported only now (hf's pulls in torch)."""
    try:
        return entry.builder()
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"backend {entry.name!r} needs {exc.name!r}, which is not installed; "
            "install the worker extra: pip install 'tokenq[worker]'"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"backend {entry.name!r}: importing {entry.build} raised {type(exc).__name__}: {exc}"
        ) from exc


def _plugin_factory(spec: str) -> Callable[[Any], Any]:
    """The callable a ``package.module:factory`` spec names."""
    match = _PLUGIN_SPEC.match(spec)
    if match is None:
        names = ", ".join(repr(entry.name) for entry in registered())
        raise ConfigError(
            f"backend {spec!r} is not {names} or a plugin as 'package.module:factory'"
        )
    module_name, attr_path = match["module"], match["attr"]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(
                f"backend {spec!r}: module {module_name!r} not found (is it installed, "
                "or on PYTHONPATH?)"
            ) from None
        raise ConfigError(
            f"backend {spec!r}: importing {module_name!r} failed, it needs {exc.name!r}, "
            "which is not installed"
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"backend {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    try:
        target = functools.reduce(getattr, attr_path.split("."), module)
    except AttributeError:
        raise ConfigError(
            f"backend {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
        ) from None
    if not callable(target):
        raise ConfigError(
            f"backend {spec!r}: {attr_path!r} is a {type(target).__name__}, not a callable "
            "factory(settings) -> Backend"
        )
    return target


def _call(factory: Callable[[Any], Any], settings: Any, spec: str) -> Any:
    """Call a factory; anything it raises becomes a ConfigError naming the spec."""
    try:
        return factory(settings)
    except ConfigError as exc:
        raise ConfigError(f"backend {spec!r}: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"backend {spec!r}: the factory raised {type(exc).__name__}: {exc}"
        ) from exc


def _checked(backend: Any, spec: str) -> Backend:
    """Refuse a factory result that is not a Backend, naming what is wrong with it."""
    problem = _problem(backend)
    if problem is not None:
        raise ConfigError(f"backend {spec!r}: {problem}")
    return cast(Backend, backend)


def _problem(backend: Any) -> str | None:
    kind = type(backend).__name__
    missing = [name for name in _BACKEND_MEMBERS if not hasattr(backend, name)]
    if missing:
        return (f"the factory returned a {kind}, which lacks {', '.join(missing)} "
                "(see tokenq.worker.backends.base.Backend)")
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
