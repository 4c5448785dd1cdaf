"""docker/k8s/: every manifest parses, and what tokenq depends on matches the code.

No cluster here: the manifests are read as YAML and held against the code's
own names — the settings' environment variables, the metrics and gateway
ports, the request stream's key, the stop graces — so a renamed setting or
a moved port fails here, not in a rollout. One test runs tokenq's publish
script on a real Redis to show that the stream's length is the number of
unanswered requests, the figure the KEDA trigger scales on.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio as aioredis
import yaml

from tests.conftest import REPO_ROOT
from tests.settings_env import settings_from
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import ENV_PREFIX, ServeSettings, env_var
from tokenq.worker.settings import WorkerSettings

K8S = REPO_ROOT / "docker" / "k8s"
QUEUE = "embed"  # the queue README.md and docs/OPERATIONS.md use throughout
SECRET_STANDIN = "0123abcd"  # what a hex password from the Secret looks like


# ----------------------------------------------------------------- reading the manifests


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    return docs


def find(manifests: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [m for m in manifests
             if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    [only] = pod_spec(workload)["containers"]
    return only


def env_of(box: dict[str, Any]) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: secrets stand in, $(VAR) expanded."""
    env: dict[str, str] = {}
    for item in box.get("env", []):
        if "valueFrom" in item:
            assert set(item["valueFrom"]) == {"secretKeyRef"}, item
            env[item["name"]] = SECRET_STANDIN
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(item["value"]))
            env[item["name"]] = value
    return env


def tokenq_env(box: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in env_of(box).items() if k.startswith(ENV_PREFIX)}


def port_number(box: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in box["ports"] if p["name"] == port]
    return number


@pytest.fixture(scope="module")
def worker(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "Deployment", f"tokenq-worker-{QUEUE}")


@pytest.fixture(scope="module")
def gateway(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "Deployment", "tokenq-gateway")


@pytest.fixture(scope="module")
def redis_set(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "StatefulSet", "tokenq-redis")


@pytest.fixture(scope="module")
def trigger(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    [length] = [t for t in find(manifests, "ScaledObject")["spec"]["triggers"]
                if t["type"] == "redis-streams"]
    return length


@pytest.fixture(scope="module")
def token_trigger(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    [tokens] = [t for t in find(manifests, "ScaledObject")["spec"]["triggers"]
                if t["type"] == "prometheus"]
    return tokens


def redis_conf(manifests: list[dict[str, Any]]) -> dict[str, str]:
    text = find(manifests, "ConfigMap", "tokenq-redis-config")["data"]["redis.conf"]
    conf = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.strip().partition(" ")
            conf[name] = value
    return conf


def redis_bytes(size: str) -> int:
    """Redis's units: 1gb is 1024**3 bytes, 1g is 10**9."""
    units = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "k": 10**3, "m": 10**6, "g": 10**9}
    number, unit = re.fullmatch(r"(\d+)([a-z]*)", size.lower()).groups()  # type: ignore[union-attr]
    return int(number) * units.get(unit, 1)


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * units.get(unit, 1)


# ----------------------------------------------------------------- the set of files


@pytest.mark.unit
def test_the_kustomization_lists_every_manifest(manifests):
    on_disk = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == on_disk
    for doc in manifests:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
        assert doc["metadata"]["name"]
        # kustomize puts every object in the one namespace; none names another.
        assert doc["metadata"].get("namespace") in (None, kustomization()["namespace"])
    assert find(manifests, "Namespace")["metadata"]["name"] == kustomization()["namespace"]


@pytest.mark.unit
def test_kustomize_sets_every_tokenq_image(worker, gateway):
    images = {entry["name"] for entry in kustomization()["images"]}
    for workload in (worker, gateway):
        assert container(workload)["image"].split(":")[0] in images


# ----------------------------------------------------------------- settings


@pytest.mark.unit
@pytest.mark.parametrize(("name", "settings_cls"), [
    ("worker", WorkerSettings), ("gateway", ServeSettings),
])
def test_every_tokenq_variable_is_a_real_setting(name, settings_cls, request, monkeypatch):
    box = container(request.getfixturevalue(name))
    env = tokenq_env(box)
    real = {env_var(field) for field in settings_cls.model_fields}
    assert set(env) <= real, sorted(set(env) - real)
    # ... and its value is one the setting accepts, read the way the process reads it.
    settings = settings_from(env, settings_cls, monkeypatch)
    assert settings.queue == QUEUE
    assert urlsplit(settings.redis_url).password == SECRET_STANDIN


@pytest.mark.unit
def test_no_service_link_can_reach_a_tokenq_setting(manifests):
    """Service links would define <SERVICE>_PORT and the like in every pod: tokenq reads
    TOKENQ_*, so they are off, and no Service's variables would name a setting anyway."""
    for doc in manifests:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            assert pod_spec(doc)["enableServiceLinks"] is False, doc["metadata"]["name"]
    fields = set(WorkerSettings.model_fields) | set(ServeSettings.model_fields)
    for service in (doc for doc in manifests if doc["kind"] == "Service"):
        stem = service["metadata"]["name"].upper().replace("-", "_")
        for suffix in ("SERVICE_HOST", "SERVICE_PORT", "PORT"):
            link = f"{stem}_{suffix}"
            assert not (link.startswith(ENV_PREFIX)
                        and link.removeprefix(ENV_PREFIX).lower() in fields), link


# ----------------------------------------------------------------- the worker


@pytest.mark.unit
def test_worker_probes_hit_its_metrics_port(worker):
    box = container(worker)
    port = int(tokenq_env(box)["TOKENQ_METRICS_PORT"])
    assert port != 0, "TOKENQ_METRICS_PORT 0 turns the endpoint (and the probes' target) off"
    assert WorkerSettings.model_fields["metrics_port"].default == 0  # so it must be set here
    paths = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
    for probe, path in paths.items():
        get = box[probe]["httpGet"]
        assert get["path"] == path, probe
        assert port_number(box, get["port"]) == port, probe
    startup = box["startupProbe"]
    # Long enough for a model download and load before liveness starts counting.
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600


@pytest.mark.unit
def test_the_probes_reach_the_worker_metrics_host(worker, monkeypatch):
    """The kubelet probes the pod's IP, which the worker's default loopback bind refuses."""
    settings = settings_from(tokenq_env(container(worker)), WorkerSettings, monkeypatch)
    assert settings.metrics_host == "0.0.0.0"  # type: ignore[attr-defined]
    assert WorkerSettings.model_fields["metrics_host"].default == "127.0.0.1"  # so it must be set


@pytest.mark.unit
def test_the_worker_serves_the_probe_paths():
    """/livez and /readyz are the worker's (on its metrics port), not only this file's."""
    source = "\n".join(path.read_text() for path in (REPO_ROOT / "worker").rglob("*.py"))
    missing = [path for path in ("/livez", "/readyz")
               if f'"{path}"' not in source and f"'{path}'" not in source]
    assert missing == [], f"no code under worker/ serves {missing}"


@pytest.mark.unit
def test_the_worker_holds_one_gpu_and_the_gateway_none(worker, gateway):
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 1
    for part in ("limits", "requests"):
        assert "nvidia.com/gpu" not in container(gateway)["resources"].get(part, {})


@pytest.mark.unit
def test_the_grace_period_covers_the_drain(worker):
    """SIGTERM: the batch on the device finishes or the watchdog ends it at
    batch_timeout_s; then publishing, winding down and deregistering each get a
    stop grace. Kubernetes must not SIGKILL the worker before that."""
    from tokenq.worker.loop.lifecycle import STOP_GRACE_S  # the worker's own stop graces

    box = container(worker)
    env = tokenq_env(box)
    batch_timeout = float(env.get("TOKENQ_BATCH_TIMEOUT_S",
                                  WorkerSettings.model_fields["batch_timeout_s"].default))
    drain = batch_timeout + 3 * STOP_GRACE_S
    assert pod_spec(worker)["terminationGracePeriodSeconds"] >= drain
    # A preStop sleep would delay the SIGTERM and keep the worker reading new work.
    assert "preStop" not in box.get("lifecycle", {})


@pytest.mark.unit
def test_the_worker_deployment_leaves_its_replicas_to_keda(worker, manifests):
    assert "replicas" not in worker["spec"]
    scaled = find(manifests, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] == 0  # scales from zero: no idle GPU held
    assert scaled["spec"]["maxReplicaCount"] >= 1
    # The rollout waits for a ready new pod before stopping an old one.
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# ----------------------------------------------------------------- the gateway


@pytest.mark.unit
def test_gateway_probes_match_its_routes_and_port(gateway, manifests, monkeypatch):
    from tokenq.producer.serve.app import create_app

    box = container(gateway)
    settings = settings_from(tokenq_env(box), ServeSettings, monkeypatch)
    assert settings.host == "0.0.0.0"  # the default, 127.0.0.1, is unreachable from the Service
    # an included router (openai_api's) is an entry without a path of its own
    routes = {getattr(route, "path", None) for route in create_app(settings).routes}
    assert {"/health", "/ready", "/metrics"} <= routes
    assert box["readinessProbe"]["httpGet"]["path"] == "/health"
    # Liveness must not depend on Redis (an outage would restart every gateway):
    # /metrics answers from the process alone.
    assert box["livenessProbe"]["httpGet"]["path"] == "/metrics"
    for probe in ("readinessProbe", "livenessProbe"):
        assert port_number(box, box[probe]["httpGet"]["port"]) == settings.port
    service = find(manifests, "Service", "tokenq-gateway")
    [port] = service["spec"]["ports"]
    assert port_number(box, port["targetPort"]) == settings.port
    assert service["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"][
        "labels"].items()


@pytest.mark.unit
def test_the_gateway_grace_covers_its_longest_request(gateway, monkeypatch):
    box = container(gateway)
    settings = settings_from(tokenq_env(box), ServeSettings, monkeypatch)
    command = box["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] >= (
        float(command[1]) + settings.timeout_s)


# ----------------------------------------------------------------- Redis


@pytest.mark.unit
def test_redis_is_durable_and_never_evicts(manifests, redis_set):
    conf = redis_conf(manifests)
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] == "everysec"
    assert conf["maxmemory-policy"] == "noeviction"
    box = container(redis_set)
    # noeviction acts only at maxmemory; the container needs room above it (AOF rewrite fork).
    limit = quantity_bytes(box["resources"]["limits"]["memory"])
    assert 0 < redis_bytes(conf["maxmemory"]) * 1.5 <= limit
    assert box["resources"]["requests"]["memory"] == box["resources"]["limits"]["memory"]
    # The server runs with this file, and its data directory is the claimed volume.
    mounts = {m["name"]: m["mountPath"] for m in box["volumeMounts"]}
    assert box["command"][:2] == ["redis-server", f"{mounts['config']}/redis.conf"]
    assert mounts["data"] == conf["dir"]
    [claim] = redis_set["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"


@pytest.mark.unit
def test_every_redis_url_points_at_the_redis_service(manifests, worker, gateway, redis_set):
    service = find(manifests, "Service", "tokenq-redis")
    [port] = service["spec"]["ports"]
    assert redis_set["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= redis_set["spec"]["template"]["metadata"][
        "labels"].items()
    assert port_number(container(redis_set), port["targetPort"]) == port["port"]
    for workload in (worker, gateway):
        url = urlsplit(tokenq_env(container(workload))["TOKENQ_REDIS_URL"])
        assert (url.hostname, url.port, url.path) == (service["metadata"]["name"], port["port"],
                                                     "/0")


@pytest.mark.unit
def test_every_password_comes_from_one_secret(manifests):
    refs = set()
    for doc in manifests:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for item in container(doc).get("env", []):
                if "valueFrom" in item:
                    ref = item["valueFrom"]["secretKeyRef"]
                    refs.add((ref["name"], ref["key"]))
    for target in find(manifests, "TriggerAuthentication")["spec"]["secretTargetRef"]:
        refs.add((target["name"], target["key"]))
    assert refs == {("tokenq-redis", "password")}


# ----------------------------------------------------------------- KEDA


@pytest.mark.unit
def test_keda_scales_the_worker_on_its_queue_length(trigger, worker, manifests):
    meta = trigger["metadata"]
    assert trigger["type"] == "redis-streams"
    queue = tokenq_env(container(worker))["TOKENQ_QUEUE"]
    assert meta["stream"] == keys.requests(QueueRef(queue)) == keys.requests(QueueRef(QUEUE))
    # XLEN mode: KEDA's scaler reads XLEN when no consumerGroup is named (with one it
    # reads the group's pending count or lag instead; keda.yaml says why not).
    assert "consumerGroup" not in meta
    assert not {"lagCount", "pendingEntriesCount"} & set(meta)
    assert int(meta["streamLength"]) > 0
    assert int(meta["activationLagCount"]) >= 0
    # Same Redis as the workers', addressed from KEDA's own namespace.
    service = find(manifests, "Service", "tokenq-redis")
    [port] = service["spec"]["ports"]
    host, _, number = meta["address"].rpartition(":")
    assert host == f"{service['metadata']['name']}.{kustomization()['namespace']}.svc"
    assert int(number) == port["port"]
    url = urlsplit(tokenq_env(container(worker))["TOKENQ_REDIS_URL"])
    assert url.path == f"/{meta['databaseIndex']}"
    auth = find(manifests, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert [t["parameter"] for t in auth["spec"]["secretTargetRef"]] == ["password"]


@pytest.mark.unit
def test_keda_scales_on_pending_tokens_over_measured_tokens_per_second(token_trigger, worker):
    """The prometheus trigger reads the figures the workers export, for their own queue;
    it never comes back empty (which KEDA would read as an error or 0 alike), and the
    length trigger, which needs no worker, wakes the fleet from zero."""
    from tokenq.worker.metrics import Metrics

    meta = token_trigger["metadata"]
    queue = tokenq_env(container(worker))["TOKENQ_QUEUE"]
    metrics = Metrics(queue)
    metrics.queue_depth(1, 0, 1, 500)
    exported = {m.name for m in metrics.registry.collect()}
    query = " ".join(meta["query"].split())
    named = set(re.findall(r"(tokenq_\w+)\{queue=\"([^\"]+)\"\}", query))
    assert named == {("tokenq_queue_pending_tokens", queue), ("tokenq_tokens_total", queue)}
    assert {"tokenq_queue_pending_tokens", "tokenq_tokens"} <= exported
    assert query.startswith("(max(tokenq_queue_pending_tokens") and "/" in query
    assert "or vector(2000)" in query and query.endswith("or vector(0)")  # from zero: 0, not empty
    assert float(meta["threshold"]) > 0 and float(meta["activationThreshold"]) >= 0


@pytest.mark.unit
def test_from_zero_the_gateways_export_the_pending_tokens_and_wait_out_the_cold_start(
        token_trigger, gateway, worker):
    """With no worker running, the prometheus trigger still reads the queue's pending tokens
    (every tenant's): the gateways export them; and a gateway queues a request while no
    worker is alive (a 503 would queue nothing, and KEDA would never wake one)."""
    from tokenq.producer.serve.app import Gateway
    from tokenq.shared.settings import ServeSettings

    env = tokenq_env(container(gateway))
    assert env["TOKENQ_QUEUE"] == tokenq_env(container(worker))["TOKENQ_QUEUE"]
    assert 0 < float(env["TOKENQ_COLD_START_S"]) <= float(env["TOKENQ_TIMEOUT_S"])
    served = Gateway(ServeSettings(queue=env["TOKENQ_QUEUE"]))
    served.pending.labels(env["TOKENQ_QUEUE"]).set(7)
    exported = {(sample.name, sample.labels.get("queue")) for family in served.registry.collect()
                for sample in family.samples}
    assert ("tokenq_queue_pending_tokens", env["TOKENQ_QUEUE"]) in exported
    assert "max(tokenq_queue_pending_tokens" in " ".join(token_trigger["metadata"]["query"].split())


def test_the_stream_length_is_every_unanswered_request(redis_url, queue_name):
    """What the trigger reads. tokenq's publish script deletes each entry it answers,
    so XLEN = unread + held by workers, whatever order they answer in; the group's
    lag (XINFO GROUPS) counts only the unread, and Redis often cannot count it at all
    once answered entries are deleted out of order."""
    from tokenq.worker.loop.publish import Publisher, Target
    from tokenq.worker.pipeline.jobs import Answer

    queue = QueueRef(queue_name)
    stream = keys.requests(queue)
    sync = redis.Redis.from_url(redis_url)
    sync.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    ids = [sync.xadd(stream, {"n": str(i)}) for i in range(10)]
    sync.xreadgroup(keys.GROUP, "w1", {stream: ">"}, count=4)  # one worker reads ahead 4

    async def answer(entry_ids: list[bytes]) -> None:
        client = aioredis.Redis.from_url(redis_url)
        publisher = Publisher(client, Target(stream, keys.dead(queue), keys.GROUP, "w1"),
                              reply_ttl_ms=1000, dead_max_len=10,
                              dead_max_letter_bytes=1024)
        answers = [Answer(i, keys.reply(queue, i.decode()), b"x", ok=True) for i in entry_ids]
        assert await publisher.publish_once(answers) == len(entry_ids)
        await client.aclose()

    def unanswered() -> tuple[int, int]:
        [group] = sync.xinfo_groups(stream)
        return sync.xlen(stream), group["pending"]

    assert unanswered() == (10, 4)
    asyncio.run(answer([ids[3]]))      # the packer answers the last one read first
    assert unanswered() == (9, 3)      # 6 unread + 3 held
    asyncio.run(answer([ids[0], ids[1], ids[2]]))
    assert unanswered() == (6, 0)
    sync.close()


# ----------------------------------------------------------------- docs


@pytest.mark.unit
def test_operations_walks_through_these_manifests():
    text = (REPO_ROOT / "docs" / "OPERATIONS.md").read_text()
    section = text[text.index("## Kubernetes and KEDA"):]
    for needle in ("kubectl apply -k docker/k8s", "XINFO GROUPS", "tokenq top",
                   "minReplicaCount", "startupProbe", keys.requests(QueueRef(QUEUE))):
        assert needle in section, needle
