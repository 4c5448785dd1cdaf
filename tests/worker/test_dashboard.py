"""The Grafana dashboard and docs/METRICS.md name only metrics a worker exports.

Why: a renamed metric breaks a dashboard silently (the panel just goes
empty), and a documented metric that no longer exists misleads whoever
writes an alert. The names a worker exports are read from its registry
(every tokenq series is present from the start, at 0); tests/worker/test_metrics.py
checks that a real worker's scrape holds the documented ones too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tokenq.worker import metrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "tokenq-dashboard.json"
METRICS_MD = ROOT / "docs" / "METRICS.md"

_NAME = re.compile(r"\b((?:tokenq|process|python)_[A-Za-z0-9_]*)")
_ROW = re.compile(r"^\| `([a-z_]+)`", re.MULTILINE)
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def documented_metrics() -> list[str]:
    """Every metric named in the first column of METRICS.md's metrics table."""
    text = METRICS_MD.read_text()
    table = text[text.index("## Metrics"):text.index("## Reading them")]
    return _ROW.findall(table)


def exported_samples() -> set[str]:
    """Every sample name a worker's registry exposes (tokenq's and the process collectors')."""
    worker = metrics.Metrics("q")
    worker.describe(consumer="c", model="m", backend="sim", device="cpu")
    return {sample.name for family in worker.registry.collect() for sample in family.samples}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL text in the dashboard: panel targets and template variable queries."""
    found = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", []) if "expr" in target]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable.get("type") == "query":
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_samples()


def test_every_metric_the_dashboard_queries_is_exported(exported: set[str]):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    used = {name for expr in exprs for name in _NAME.findall(expr)}
    assert not used - exported, sorted(used - exported)
    assert any(name.startswith("process_") for name in used)


def test_the_dashboard_has_the_panels_an_operator_needs():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(expressions(dashboard))
    for family in ("tokenq_requests_total", "tokenq_queue_lag", "tokenq_queue_length",
                   "tokenq_request_duration_seconds_bucket", "tokenq_inference_seconds_sum",
                   "tokenq_batch_tokens_bucket", "tokenq_batch_padding_efficiency_ratio_bucket",
                   "tokenq_oom_splits_total", "tokenq_tokenization_seconds_bucket"):
        assert family in exprs, family
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
    assert all('queue=~"$queue"' in target["expr"] for panel in dashboard["panels"]
               for target in panel["targets"])


def test_every_documented_metric_is_exported(exported: set[str]):
    documented = documented_metrics()
    assert "tokenq_batch_padding_efficiency_ratio" in documented
    assert "tokenq_batch_padding_efficiency" not in documented
    missing = [name for name in documented
               if name not in exported and f"{name}_count" not in exported
               and not any(sample.startswith(name) for sample in exported)]
    assert not missing, missing


def test_every_exported_tokenq_metric_is_documented(exported: set[str]):
    documented = set(documented_metrics())

    def family(sample: str) -> str:
        for suffix in _HISTOGRAM_SERIES:
            if sample.endswith(suffix) and sample.removesuffix(suffix) in documented:
                return sample.removesuffix(suffix)
        return sample

    undocumented = sorted({family(s) for s in exported if s.startswith("tokenq_")} - documented)
    assert not undocumented, undocumented
