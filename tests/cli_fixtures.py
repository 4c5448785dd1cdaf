"""Fixtures of the operator-command tests; load with ``pytest_plugins = ("tests.cli_fixtures",)``.

Kept apart from :mod:`tests.cli_support` (plain helpers the tests import) so
pytest can rewrite this module's asserts when it loads it as a plugin.
"""

from __future__ import annotations

from tests.support import FAST_BEAT, SIM_FLAGS, starter_fixture

sim_worker = starter_fixture("sim_worker", *SIM_FLAGS, *FAST_BEAT)
"""``sim_worker(*flags, name=None, wait=True)``: sim workers on this test's queue
(heartbeat every 0.5 s); all closed after the test."""
