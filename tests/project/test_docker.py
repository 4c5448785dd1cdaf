"""docker/: compose.yaml, the Dockerfile and prometheus.yml, held against the code's settings.

No Docker engine here: the files are parsed (compose and Prometheus as YAML,
the Dockerfile by its instructions) and their settings, ports and paths
checked against tokenq's own — a variable compose passes must be a real
setting with a value the setting accepts, the healthchecks must hit the
port the worker serves on, Prometheus must find every replica.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.settings_env import settings_from
from tokenq.shared.settings import ENV_PREFIX, ServeSettings, env_var
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit

DOCKER = REPO_ROOT / "docker"
WORKERS = ("worker", "worker-allgpus", "worker-cpu")
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (DOCKER / "Dockerfile").read_text()


def stages(text: str) -> dict[str, str]:
    """The Dockerfile's build stages by name (``FROM image AS name``), each its own text."""
    found: dict[str, str] = {}
    parts = re.split(r"^FROM ", text, flags=re.M)
    for part in parts[1:]:
        head = part.splitlines()[0]
        match = re.fullmatch(r"\S+ AS (\w+)", head)
        assert match, f"unnamed stage: FROM {head}"
        found[match.group(1)] = part
    return found


def instructions(text: str) -> list[str]:
    """A Dockerfile's instructions, one a line: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", re.sub(r"^\s*#.*\n", "", text, flags=re.M))
    return [line.strip() for line in joined.splitlines() if line.strip()]


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set in the shell: the default."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def container_env(service: dict[str, Any]) -> dict[str, str]:
    """What the container gets with an empty shell: passthrough (no value) entries are unset."""
    return {name: interpolate(str(value)) for name, value in service["environment"].items()
            if value is not None}


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def size_bytes(size: str) -> int:
    """Redis (2gb: 1024**3) and compose (3g: binary too) sizes."""
    number, unit = re.fullmatch(r"(\d+)([a-z]*)", size.lower()).groups()  # type: ignore[union-attr]
    return int(number) * {"": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
                          "g": 1 << 30, "gb": 1 << 30}[unit]


# ----------------------------------------------------------------- Redis


def test_redis_is_durable_and_never_evicts(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "redis-server"
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "everysec"
    assert flags["--maxmemory-policy"] == "noeviction"
    # noeviction acts only at maxmemory; the container needs room above it
    # (the fork of an AOF rewrite, client buffers).
    assert 0 < size_bytes(flags["--maxmemory"]) * 1.5 <= size_bytes(redis["mem_limit"])
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    # Healthy on PONG only: a Redis loading its AOF answers LOADING.
    assert redis["healthcheck"]["test"][0] == "CMD-SHELL"
    assert "grep -q PONG" in redis["healthcheck"]["test"][1]


# ----------------------------------------------------------------- workers and gateway


def test_worker_scales_and_reserves_a_gpu(compose):
    worker = compose["services"]["worker"]
    # --scale needs no fixed name and no published host port.
    assert "container_name" not in worker and "ports" not in worker
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1
    assert "gpu" in device["capabilities"]
    env = worker["environment"]
    assert env["TOKENQ_REDIS_URL"] == "redis://redis:6379/0"
    assert worker["stop_signal"] == "SIGTERM"
    assert worker["build"]["dockerfile"] == "docker/Dockerfile"
    assert worker["build"]["context"] == ".."


@pytest.mark.parametrize(("names", "settings_cls"), [
    (WORKERS, WorkerSettings), (("gateway",), ServeSettings),
])
def test_every_tokenq_variable_is_a_real_setting(compose, names, settings_cls, monkeypatch):
    real = {env_var(field) for field in settings_cls.model_fields}
    for name in names:
        service = compose["services"][name]
        given = {v for v in service["environment"] if v.startswith(ENV_PREFIX)}
        assert given <= real, (name, sorted(given - real))
        # With nothing set in the shell, each value is one the setting accepts.
        settings = settings_from(container_env(service), settings_cls, monkeypatch)
        assert settings.queue == "embed"  # README's queue, as in `tokenq stats --queue embed`


def test_the_worker_settings_a_user_sets_are_passed_through(compose):
    """Set in the shell or docker/.env, these reach the workers; unset, the worker's
    default holds (a ${VAR:-} would pass an empty string, which no setting accepts)."""
    env = compose["services"]["worker"]["environment"]
    wanted = {"TOKENQ_MODEL", "TOKENQ_TASK", "TOKENQ_DTYPE", "TOKENQ_MAX_INPUT_TOKENS",
              "TOKENQ_MAX_BATCH_SIZE", "TOKENQ_LINGER_MS", "TOKENQ_POLICY",
              "TOKENQ_BATCH_TIMEOUT_S", "TOKENQ_LOG_LEVEL", "TOKENQ_MAX_BATCH_TOKENS",
              "TOKENQ_QUEUE", "TOKENQ_BACKEND"}
    for name in wanted:
        assert name in env, name
        # No value (passthrough), or ${NAME:-default} of the same name.
        interpolated = INTERPOLATION.fullmatch(str(env[name]))
        assert env[name] is None or (interpolated and interpolated.group(1) == name), name
    assert "HF_TOKEN" in env and env["HF_TOKEN"] is None  # gated models, never written here
    for name in WORKERS:
        assert compose["services"][name]["environment"].keys() >= wanted


def test_healthchecks_hit_the_worker_and_gateway_ports(compose, dockerfile):
    services = compose["services"]
    port = int(services["worker"]["environment"]["TOKENQ_METRICS_PORT"])
    assert port != 0 and WorkerSettings.model_fields["metrics_port"].default == 0
    assert str(port) in services["worker"]["expose"]
    for name in WORKERS:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], name  # urllib: the image has no curl
        assert "urllib.request" in test[3] and "/livez" in test[3]
        assert "os.environ['TOKENQ_METRICS_PORT']" in test[3]
        assert seconds(services[name]["healthcheck"]["start_period"]) >= 300  # a model download
    gateway = services["gateway"]
    assert "/health" in gateway["healthcheck"]["test"][3]
    assert "os.environ['TOKENQ_PORT']" in gateway["healthcheck"]["test"][3]
    assert gateway["ports"] == [f"127.0.0.1:{gateway['environment']['TOKENQ_PORT']}:"
                                f"{gateway['environment']['TOKENQ_PORT']}"]
    # The images' own HEALTHCHECKs: the same endpoints, the same variables.
    by_stage = stages(dockerfile)
    for stage, variable, default, path in (("worker", "TOKENQ_METRICS_PORT", port, "/livez"),
                                           ("gateway", "TOKENQ_PORT", 8080, "/health")):
        lines = instructions(by_stage[stage])
        [check] = [line for line in lines if line.startswith("HEALTHCHECK ")]
        assert 'CMD ["python", "-c", ' in check and "urllib.request" in check
        assert f"os.environ.get('{variable}', '{default}')" in check and path in check
        assert any(line.startswith("ENV ") and re.search(rf"\b{variable}={default}\b", line)
                   for line in lines), stage
    assert ServeSettings.model_fields["port"].default == 8080


def test_prometheus_reaches_every_worker_metrics_host(compose, dockerfile, monkeypatch):
    """Prometheus scrapes from its own container, which the default loopback bind refuses."""
    assert WorkerSettings.model_fields["metrics_host"].default == "127.0.0.1"
    for name in WORKERS:
        env = container_env(compose["services"][name])
        settings = settings_from(env, WorkerSettings, monkeypatch)
        assert settings.metrics_host == "0.0.0.0", name  # type: ignore[attr-defined]
    # The image's own default, for `docker run` without compose.
    lines = instructions(stages(dockerfile)["worker"])
    assert any(line.startswith("ENV ") and re.search(r"\bTOKENQ_METRICS_HOST=0\.0\.0\.0\b", line)
               for line in lines)


def test_redis_is_healthy_before_anything_starts_on_it(compose):
    for name in (*WORKERS, "gateway"):
        assert compose["services"][name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_stop_grace_covers_the_worker_drain(compose):
    """The batch on the device finishes or the watchdog ends it (batch_timeout_s),
    then the worker's three stop graces (publish, wind down, deregister)."""
    from tokenq.worker.loop.lifecycle import STOP_GRACE_S  # the worker's own stop graces

    drain = WorkerSettings.model_fields["batch_timeout_s"].default + 3 * STOP_GRACE_S
    for name in WORKERS:
        assert seconds(compose["services"][name]["stop_grace_period"]) >= drain, name
    gateway = compose["services"]["gateway"]
    assert seconds(gateway["stop_grace_period"]) >= ServeSettings.model_fields["timeout_s"].default


def test_optional_services_sit_behind_profiles(compose):
    services = compose["services"]
    assert services["prometheus"]["profiles"] == ["metrics"]
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["worker-cpu"]
    assert services["worker-cpu"]["build"]["args"]["TORCH"] == "cpu"
    assert services["worker-allgpus"]["profiles"] == ["multigpu"]
    allgpus = services["worker-allgpus"]
    assert allgpus["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert "TOKENQ_DEVICES" in allgpus["environment"]
    for always in ("redis", "worker", "gateway"):
        assert "profiles" not in services[always], always


def test_compose_builds_targets_the_dockerfile_has(compose, dockerfile):
    targets = set(stages(dockerfile))
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["build"]["target"] in targets, name


# ----------------------------------------------------------------- Prometheus


def test_prometheus_follows_docker_compose_scale(compose):
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    services = compose["services"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for job in jobs.values():
        # DNS discovery on service names: one A record per replica, however many.
        assert "static_configs" not in job, job["job_name"]
        for sd in job["dns_sd_configs"]:
            assert sd["type"] == "A"
            assert set(sd["names"]) <= set(services), sd["names"]
    metrics_port = int(services["worker"]["environment"]["TOKENQ_METRICS_PORT"])
    [sd] = jobs["tokenq-worker"]["dns_sd_configs"]
    assert set(sd["names"]) == {"worker", "worker-cpu"} and sd["port"] == metrics_port
    # --devices: child i serves metrics_port + i; as many ports as the default has devices, or more.
    ports = [sd["port"] for sd in jobs["tokenq-worker-allgpus"]["dns_sd_configs"]]
    assert ports == list(range(metrics_port, metrics_port + len(ports)))
    devices = interpolate(services["worker-allgpus"]["environment"]["TOKENQ_DEVICES"])
    assert len(ports) >= len(devices.split(","))
    [sd] = jobs["tokenq-gateway"]["dns_sd_configs"]
    assert sd["names"] == ["gateway"]
    assert sd["port"] == int(services["gateway"]["environment"]["TOKENQ_PORT"])
    mounts = services["prometheus"]["volumes"]
    assert any(m.startswith("./prometheus.yml:/etc/prometheus/prometheus.yml") for m in mounts)


# ----------------------------------------------------------------- the Dockerfile


def test_one_copy_of_cuda_the_torch_wheels(dockerfile):
    """python:slim plus PyPI's torch wheel, which brings its CUDA runtime as nvidia-*
    wheels; an nvidia/cuda base would be a second, unused copy."""
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert froms and not any("nvidia" in image or "cuda" in image for image in froms)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim$", dockerfile, re.M)
    assert froms[0] == "${PYTHON_IMAGE}"
    worker = stages(dockerfile)["worker"]
    assert re.search(r"^ARG TORCH=cpu$", worker, re.M)
    cuda = re.search(r"^\s*cuda\) (.*)$", worker, re.M).group(1)  # type: ignore[union-attr]
    assert cuda.startswith('pip install "torch') and "--index-url" not in cuda  # PyPI's wheel
    cpu = re.search(r"^\s*cpu\) (.*)$", worker, re.M).group(1)  # type: ignore[union-attr]
    assert "--index-url" in cpu
    # libcuda comes from the driver through the toolkit, which mounts it only
    # for the compute capability; the runtime, not the image, picks the GPUs.
    assert re.search(r"NVIDIA_DRIVER_CAPABILITIES=compute,utility", worker)
    assert "NVIDIA_VISIBLE_DEVICES" not in re.sub(r"#.*", "", worker)


def test_dockerfile_stages_run_the_two_commands(dockerfile):
    by_stage = stages(dockerfile)
    assert list(by_stage) == ["base", "gateway", "worker"]  # worker last: the default target
    for stage, extra, command in (("worker", "worker", "worker"), ("gateway", "serve", "serve")):
        text = by_stage[stage]
        assert f'pip install ".[{extra}]"' in text
        for folder in ("shared", "producer", "worker"):
            assert f"COPY {folder} {folder}" in text
        assert re.search(r"^USER tokenq$", text, re.M)
        assert re.search(r'^ENTRYPOINT \["tokenq"\]$', text, re.M)
        assert re.search(rf'^CMD \["{command}"\]$', text, re.M)
        assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    # torch before the source: editing tokenq does not download torch again.
    worker = by_stage["worker"]
    assert worker.index('pip install "torch') < worker.index("COPY shared shared")
    # The gateway listens on every interface in a container.
    assert re.search(r"TOKENQ_HOST=0\.0\.0\.0", by_stage["gateway"])
    assert "torch" not in re.sub(r"#.*", "", by_stage["gateway"])
