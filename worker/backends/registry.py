"""Which backends exist: :class:`BackendEntry` (name, settings, builder) from :data:`BUILT_IN`,
``tokenq.backends`` entry points, or a ``--backend pkg.mod:attr`` naming one."""

from __future__ import annotations

import functools
import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from tokenq.shared.errors import ConfigError
from tokenq.shared.failures import error_text
from tokenq.shared.settings import BackendSettings

log = logging.getLogger("tokenq.worker")

ENTRY_POINT_GROUP = "tokenq.backends"

BUILT_IN: tuple[str, ...] = (
    "tokenq.worker.backends.hf.settings:BACKEND",
    "tokenq.worker.backends.sim_settings:BACKEND",
)


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One backend: what ``--backend`` calls it, its settings and how it is built."""

    name: str  # the --backend value of a registered backend; a plugin's label
    settings: type[BackendSettings]  # its own flags, TOKENQ_* variables, --help heading
    build: Callable[[Any], Any] | str  # builder(settings) -> Backend, or its "module:function"

    def __call__(self, settings: Any) -> Any:
        """Build the backend (a builder named by path is imported now): an entry is also
        the ``factory(settings)`` a plugin names."""
        return (resolve(self.build) if isinstance(self.build, str) else self.build)(settings)


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_SPEC = re.compile(rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*$")


def resolve(spec: str) -> Any:
    """The object a ``package.module:attribute`` spec names, or a ConfigError saying why not."""
    if not _SPEC.match(spec):
        names = ", ".join(repr(entry.name) for entry in registered())
        raise ConfigError(f"it is not {names} or a plugin as 'package.module:factory'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        why = (
            f"module {module_name!r} not found"
            if exc.name and (module_name + ".").startswith(exc.name + ".")
            else f"importing {module_name!r} failed, it needs {exc.name!r}, which is not installed"
        )
        hint = (
            "install the worker extra: pip install 'tokenq[worker]'"
            if module_name.startswith("tokenq.")
            else "is it installed, or on PYTHONPATH?"
        )
        raise ConfigError(f"{why} ({hint})") from exc
    except Exception as exc:
        raise ConfigError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    try:
        return functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None


@functools.cache
def registered() -> tuple[BackendEntry, ...]:
    """Every registered backend: built-in, then entry points (one that fails is logged)."""
    found = [resolve(path) for path in BUILT_IN]
    names = {entry.name for entry in found}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in names:
            continue
        try:
            entry = point.load()
        except Exception as exc:  # a broken third-party package: say so, go on
            log.warning("backend entry point %r failed to load: %s", point.name, error_text(exc))
            continue
        if isinstance(entry, BackendEntry):
            found.append(entry)
            names.add(entry.name)
    return tuple(found)


def by_name(name: str) -> BackendEntry | None:
    return next((entry for entry in registered() if entry.name == name.strip()), None)


@functools.cache
def entry_for(spec: str) -> BackendEntry | None:
    """The entry of the backend a ``--backend`` value chooses: registered, or a plugin's
    ``pkg.mod:attr`` naming one; None for a plain factory or a spec that does not import."""
    if found := by_name(spec):
        return found
    try:
        target = resolve(spec.strip())
    except Exception:  # reported, with its cause, when the backend is loaded
        return None
    return target if isinstance(target, BackendEntry) else None
