"""docker/: compose.yaml's structure and the Dockerfile's build args (no Docker engine here)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tokenq.shared.settings import WorkerSettings

DOCKER = REPO_ROOT / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_redis_is_durable_and_never_evicts(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "redis-server"
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "everysec"
    assert flags["--maxmemory-policy"] == "noeviction"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert redis["healthcheck"]["test"][-1] == "ping"


def test_worker_scales_and_reserves_a_gpu(compose):
    worker = compose["services"]["worker"]
    # --scale needs no fixed name and no published host port.
    assert "container_name" not in worker and "ports" not in worker
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1
    assert "gpu" in device["capabilities"]
    env = worker["environment"]
    assert env["TOKENQ_REDIS_URL"] == "redis://redis:6379/0"
    assert env["TOKENQ_METRICS_PORT"] == "9100"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["stop_signal"] == "SIGTERM"
    assert worker["build"]["dockerfile"] == "docker/Dockerfile"
    assert worker["build"]["context"] == ".."


def test_every_worker_variable_is_a_real_setting(compose):
    fields = set(WorkerSettings.model_fields)
    for name in ("worker", "worker-allgpus", "worker-cpu"):
        for variable in compose["services"][name]["environment"]:
            if variable.startswith("TOKENQ_"):
                assert variable.removeprefix("TOKENQ_").lower() in fields, variable


def test_optional_services_sit_behind_profiles(compose):
    services = compose["services"]
    assert services["prometheus"]["profiles"] == ["metrics"]
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["worker-cpu"]
    assert services["worker-allgpus"]["profiles"] == ["multigpu"]
    allgpus = services["worker-allgpus"]
    assert allgpus["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert "TOKENQ_DEVICES" in allgpus["environment"]
    assert "profiles" not in services["redis"] and "profiles" not in services["worker"]


def test_prometheus_scrapes_the_workers_metrics_port(compose):
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "tokenq-worker"]
    [sd] = job["dns_sd_configs"]
    assert "worker" in sd["names"] and sd["port"] == 9100
    mounts = compose["services"]["prometheus"]["volumes"]
    assert any(m.startswith("./prometheus.yml:/etc/prometheus/prometheus.yml") for m in mounts)


def test_dockerfile_picks_torch_by_build_arg():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"^ARG TORCH=cpu$", text, re.M)
    assert "cpu) pip install" in text and "cuda) pip install" in text
    assert 'pip install ".[worker]"' in text
    assert re.search(r'^ENTRYPOINT \["tokenq"\]$', text, re.M)
    assert re.search(r'^CMD \["worker"\]$', text, re.M)
    assert re.search(r"^USER tokenq$", text, re.M)
    for folder in ("shared", "producer", "worker"):
        assert f"COPY {folder} {folder}" in text
