"""How ``pytest -n N`` (xdist's default ``--dist load``) hands tests to its processes.

xdist's own ``load`` sends tests in collection order, a few at a time, so a module's
tests land on every process and each builds the module's fixtures (a model fleet, a
cluster, a wheel: up to a minute each), and a minutes-long test collected late runs
alone at the end. Its ``xdist_group`` marks would keep a module together, but with
pytest 9.2 and pytest-xdist 3.8 they have no effect (xdist renames ``item._nodeid``,
which pytest 9 no longer reads). This scheduler (``tests/conftest.py`` installs it
for ``--dist load``) sends each module of ``SHARED_FIXTURE_MODULES`` to one process
as one unit, every other test on its own, and the slowest first (``SLOW_FIRST``), so
that the short tests fill in at the end. The controller sees node ids only (it
collects nothing), hence tables of paths rather than marks.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

SHARED_FIXTURE_MODULES = frozenset(
    {
        "tests/faults/test_cluster.py",
        "tests/faults/test_cluster_connections.py",
        "tests/faults/test_cluster_fixture.py",
        "tests/faults/test_adversary_hardening.py",
        "tests/gateway/test_serve.py",
        "tests/gateway/test_serve_clients.py",
        "tests/gateway/test_serve_hf_client.py",
        "tests/models/test_bf16_mixed.py",
        "tests/models/test_e2e_models.py",
        "tests/models/test_hf_backend.py",
        "tests/models/test_hf_parity.py",
        "tests/models/test_onnx_quantize.py",
        "tests/models/test_onnx_runtime.py",
        "tests/models/test_sparse.py",
        "tests/ops/test_cli_bare_install.py",
        "tests/producer/test_any_language.py",
        "tests/project/test_gpu_check_onnx.py",
        "tests/project/test_wheel.py",
        "tests/shared/test_functions.py",
        "tests/worker/test_dashboard.py",
    }
)
"""Modules whose module-scoped fixtures (or ``tests.redis_cluster``'s) cost seconds to
build: each runs on one process. A module not named here is spread test by test."""

BENCH = "tests/project/test_bench_smoke.py"
SHARED_FIXTURE_TESTS = {
    f"{BENCH}::test_scale": f"{BENCH}::scale_results",
    f"{BENCH}::test_plots_from_results": f"{BENCH}::scale_results",
}
"""Single tests of otherwise spread modules that share a module-scoped fixture."""

SLOW_FIRST = (
    f"{BENCH}::test_real",
    f"{BENCH}::test_mixed_latency",
    f"{BENCH}::test_feed",
    "tests/models/test_e2e_models.py",
    "tests/gateway/test_serve_hf_client.py",
    "tests/gateway/test_serve_clients.py",
    "tests/models/test_sparse.py",
    "tests/gateway/test_serve.py",
    "tests/faults/test_cluster.py",
    BENCH,
    "tests/gateway/test_serve_hostile.py::test_validation_is_linear",
    "tests/gateway/test_serve_hostile.py::test_the_shapes_the_issue_names_are_linear",
    "tests/worker/test_process_stop.py::test_a_worker_stopped_past",
    "tests/faults/test_faults.py::test_kill_9_workers_repeatedly",
    "tests/faults/test_hardening.py::test_read_ahead_is_bounded_in_bytes",
    "tests/models/test_heap_trim.py",
    "tests/ops/test_cli_up.py::test_up_with_an_existing_redis",
    "tests/project/test_bench_compare.py::test_a_suite_against_head",
    "tests/worker/test_e2e_core.py::test_ten_thousand",
    "tests/models/",
    "tests/faults/",
    "tests/project/test_wheel.py",
    "tests/ops/",
    "tests/gateway/",
    "tests/worker/",
    "tests/project/",
    "tests/producer/",
)
"""Node id prefixes, roughly the slowest first (``--durations``; the ``slow`` marks): units
are sent in this order, the rest (the quick tests of tests/shared and the like) last."""


def unit_of(nodeid: str) -> str:
    """The work unit a test belongs to: its module's, its group's, or its own."""
    module = nodeid.split("::", 1)[0]
    if module in SHARED_FIXTURE_MODULES:
        return module
    return SHARED_FIXTURE_TESTS.get(nodeid.split("[", 1)[0], nodeid)


def rank(unit: str) -> int:
    return next(
        (n for n, prefix in enumerate(SLOW_FIRST) if unit.startswith(prefix)), len(SLOW_FIRST)
    )


class SharedFixtureScheduling(LoadScopeScheduling):
    """``loadscope`` with ``unit_of`` for scopes, its queue sorted by ``SLOW_FIRST``."""

    _sorted = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._sorted:  # the first call: schedule() has filled the queue
            units = sorted(self.workqueue.items(), key=lambda item: rank(item[0]))
            self.workqueue.clear()
            self.workqueue.update(units)
            self._sorted = True
        super()._assign_work_unit(node)
