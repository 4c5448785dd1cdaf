"""``tokenq functions load``: load tokenq's Lua functions where producers start before any
worker (an ACL'd producer may FCALL but not load them); ``show`` prints their names."""

from __future__ import annotations

from collections.abc import Sequence

from tokenq.producer.ops.snapshot import connection
from tokenq.shared import functions, lua_scripts
from tokenq.shared.cli import run_command
from tokenq.shared.failures import CommandFailed
from tokenq.shared.settings import FunctionsSettings

ACTIONS = {
    "load": "FUNCTION LOAD REPLACE this version's library (every primary of a Cluster)",
    "show": "print the library's name, then each function's short and full name",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(FunctionsSettings, list(argv or []), "tokenq functions", run, ACTIONS)


def run(settings: FunctionsSettings) -> int:
    library = lua_scripts.library()
    if settings.action == "show":
        print(library.name)
        for short, name in library.functions.items():
            print(f"{short}\t{name}")
        return 0
    with connection(settings.redis_url, settings.socket_timeout_s, []) as client:
        loaded = functions.load(client, missing_ok=True)
    if loaded is None:
        raise CommandFailed("this Redis has no Functions (Redis < 7): tokenq runs its "
                            "scripts by EVALSHA there, and there is nothing to load")
    print(f"loaded {loaded}: {', '.join(library.functions.values())}")
    return 0
