"""``pytest -p tests.pure_python_parser``: redis-py's own reply parser, even with hiredis installed.

The worker extra installs hiredis, so the suite normally runs with it; a
producer installed without extras reads replies with redis-py's Python
parser, and the caller-deadline guarantees (``producer/redis_deadlines.py``) must
hold on both. ``scripts/test.sh`` runs the producer's tests a second time
with this plugin. Loaded by ``-p`` before any conftest imports redis, it
makes ``import hiredis`` fail, which is how redis-py decides.
"""

import sys

sys.modules["hiredis"] = None  # type: ignore[assignment]
