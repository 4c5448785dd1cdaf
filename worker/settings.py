"""``WorkerSettings``: the worker's own settings composed with every backend's."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import model_validator

from tokenq.shared.settings import BaseWorkerSettings, env_var, flag
from tokenq.worker.backends.registry import BackendEntry, entry_for, registered


class _RefusesOtherBackends(BaseWorkerSettings):
    @model_validator(mode="after")
    def _no_options_of_another_backend(self) -> Any:
        """Refuse another backend's options, so none is silently ignored (``--model X --backend
        sim`` would serve simulated vectors under X's name); a plain factory reads any."""
        backend = self.backend.strip()
        chosen = entry_for(backend)
        if chosen is None:
            return self
        own = set(chosen.settings.model_fields)
        for other in (entry for entry in registered() if entry is not chosen):
            given = sorted(name for name in self.model_fields_set
                           if name in other.settings.model_fields and name not in own)
            if given:
                flags = ", ".join(flag(type(self), name) for name in given)
                many, owner = len(given) > 1, other.name
                raise ValueError(
                    f"--backend {backend} ignores {flags}: "
                    f"{'they are options' if many else 'it is an option'} of --backend {owner}; "
                    f"drop {'them' if many else 'it'} or use --backend {owner}")
        return self


def _compose(extra: tuple[BackendEntry, ...]) -> type[BaseWorkerSettings]:
    bases = (*(entry.settings for entry in extra), _RefusesOtherBackends)
    return type("WorkerSettings", bases, {
        "__doc__": BaseWorkerSettings.__doc__,
        "__module__": __name__,
        "__qualname__": "WorkerSettings",
    })


WorkerSettings: Any = _compose(registered())
"""The worker's settings with every registered backend's (``hf``, ``sim``, entry points)."""


def chosen_backend(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
    """The ``--backend`` a command line chooses, else ``TOKENQ_BACKEND``, else the default."""
    env = os.environ if environ is None else environ
    value = env.get(env_var("backend"), BaseWorkerSettings.model_fields["backend"].default)
    for at, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--backend" and at + 1 < len(argv):
            value = argv[at + 1]
        elif arg.startswith("--backend="):
            value = arg.partition("=")[2]
    return str(value)


def settings_class_for(argv: Sequence[str]) -> type[BaseWorkerSettings]:
    """The settings class ``tokenq worker`` parses ``argv`` with (a plugin's flags included)."""
    return _settings_class(chosen_backend(argv))


@functools.cache
def _settings_class(backend: str) -> type[BaseWorkerSettings]:
    entry = entry_for(backend)
    if entry is None or entry in registered():
        return WorkerSettings  # type: ignore[no-any-return]
    return _compose((entry, *registered()))
