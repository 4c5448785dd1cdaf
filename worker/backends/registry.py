"""Which backends exist: :class:`BackendEntry` (name, settings, builder) from
:data:`BUILT_IN`, ``tokenq.backends`` entry points, or a ``--backend pkg.mod:attr`` naming
one; the worker's settings are composed from them. A builder path is imported when built.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

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
    build: Callable[[Any], Any] | str
    """``builder(settings) -> Backend``, or its ``"module:function"`` path, imported when used."""

    def builder(self) -> Callable[[Any], Any]:
        """The builder itself, importing its module when it was named by path."""
        return _resolve(self.build) if isinstance(self.build, str) else self.build

    def __call__(self, settings: Any) -> Any:
        """Build the backend: an entry is also the ``factory(settings)`` a plugin names."""
        return self.builder()(settings)


def _resolve(path: str) -> Any:
    """The object a ``module:attribute`` path names."""
    module, _, attr = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


@functools.cache
def registered() -> tuple[BackendEntry, ...]:
    """Every registered backend: built-in, then entry points (one that fails to load is
    logged and left out)."""
    found = [_resolve(path) for path in BUILT_IN]
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
    """The registered backend ``--backend name`` names, or None."""
    return next((entry for entry in registered() if entry.name == name.strip()), None)


@functools.cache
def plugin_entry(spec: str) -> BackendEntry | None:
    """The :class:`BackendEntry` a ``pkg.mod:attr`` spec names, or None (it does not
    import, or names a plain factory)."""
    if ":" not in spec:
        return None
    try:
        target = _resolve(spec.strip())
    except Exception:  # reported, with its cause, when the backend is loaded
        return None
    return target if isinstance(target, BackendEntry) else None


def entry_for(spec: str) -> BackendEntry | None:
    """The entry of the backend a ``--backend`` value chooses (registered or plugin), or None."""
    return by_name(spec) or plugin_entry(spec)
