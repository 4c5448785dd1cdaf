"""Which backends exist and what each brings: its name, its settings and its builder.

A :class:`BackendEntry` is one line of :data:`BUILT_IN`, a ``tokenq.backends``
entry point, or a ``--backend pkg.mod:attr`` naming one (a plain factory still
works, with no settings). The worker's settings are composed from them, so a
backend's flags need no edit to ``shared/``. A ``"module:function"`` builder is
imported only when built (hf's pulls in torch).
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
"""The in-tree backends' registrations, as ``module:attribute``."""


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One backend: what ``--backend`` calls it, its settings and how it is built."""

    name: str
    """The ``--backend`` value of a registered backend (``hf``, ``sim``); a plugin's label."""
    settings: type[BackendSettings]
    """Its own settings (flags, ``TOKENQ_*`` variables, ``--help`` heading)."""
    build: Callable[[Any], Any] | str
    """``builder(settings) -> Backend``, or its ``"module:function"`` path, imported when used."""

    def builder(self) -> Callable[[Any], Any]:
        """The builder itself, importing its module when it was named by path."""
        if not isinstance(self.build, str):
            return self.build
        module, _, attr = self.build.partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]

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
    logged and left out).
    """
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
    import, or names a plain factory).
    """
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
