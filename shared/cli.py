"""The ``tokenq`` command: a thin dispatcher that imports a side only when needed.

``tokenq worker`` loads the worker (and, for real models, torch); every other
subcommand stays on the light producer side. Subcommands are looked up by
module path so this module imports neither side (``shared`` never does).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("tokenq.worker.cli", "run one worker process on a queue"),
}


def usage() -> str:
    lines = ["usage: tokenq SUBCOMMAND [options]   (tokenq SUBCOMMAND --help)", "", "subcommands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"tokenq: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
