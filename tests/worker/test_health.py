"""The worker's probes, ``/livez`` and ``/readyz`` on ``--metrics-port`` (``/health`` and
``/ready``, the gateway's names, answer the same).

Over real HTTP against real worker processes: the endpoint answers while
the model is still loading (a plugin whose load waits for a file the test
creates), ``/readyz`` turns 200 once the worker has joined, unknown paths
are 404, ``/livez`` fails once the watchdog declares the device hung
(but not merely because Redis stopped answering), and ``/readyz`` fails,
naming Redis's error, while every read fails (the stream key turned into a
string: WRONGTYPE; the ACL denying XREADGROUP: NOPERM) and recovers once a
read succeeds. The rules themselves
(:class:`~tokenq.worker.health.Health`) are also driven directly, with
the clock as an argument.
"""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.plugins_for_tests import LOAD_GATE_ENV
from tests.redis_server import RedisServer, free_ports, freezable_server
from tests.support import DIM, FAST_BEAT, SIM_FLAGS, SimModel, fleet_fixture, wait_for
from tests.workers import Fleet
from tokenq.producer import Client
from tokenq.shared import keys
from tokenq.worker.backends.sim import SIM_HANG_MARKER
from tokenq.worker.health import (
    MODEL_LOADING,
    NOT_JOINED,
    READ_FAILURES_BEFORE_UNREADY,
    STOPPING,
    Health,
)

LOCAL = ("--metrics-host", "127.0.0.1")


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of ``GET path``; (0, why) when nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError) as exc:
        return 0, str(exc)


fleet = fleet_fixture()


@pytest.fixture
def frozen_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with freezable_server(tmp_path / "redis") as own:
        yield own


# ---------------------------------------------------------------- real workers


def test_probes_answer_while_the_model_loads_and_readyz_turns_200_once_joined(
    fleet: Fleet, worker_env: dict[str, str], tmp_path: Path, r: redis.Redis, queue_name: str,
):
    port, gate = free_ports(1), tmp_path / "loaded"
    env = {**worker_env, LOAD_GATE_ENV: str(gate)}
    worker = fleet.start(
        *SimModel().flags(*FAST_BEAT, backend="tests.plugins_for_tests:sim_gated_load"),
        "--metrics-port", str(port), *LOCAL, env=env,
    )
    wait_for(lambda: get(port, "/livez")[0] == 200, 30, "the endpoint to listen")
    assert get(port, "/livez") == get(port, "/health") == (200, "ok\n")
    status, body = get(port, "/readyz")
    assert (status, body.strip()) == (503, MODEL_LOADING)
    assert get(port, "/ready") == (status, body)  # the gateway's names answer the same
    assert get(port, "/metrics")[0] == 200  # scrapes work during the load too
    for path in ("/", "/healthz", "/livez/x", "/ready/", "/metrics2"):
        assert get(port, path)[0] == 404, path
    assert worker.process.poll() is None and not gate.exists()

    gate.touch()
    worker.wait_ready(r, queue_name)
    wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "/readyz to turn 200")
    assert get(port, "/readyz") == get(port, "/ready") == (200, "ok\n")
    assert get(port, "/livez") == get(port, "/health") == (200, "ok\n")
    assert worker.terminate() == 0


def test_livez_fails_once_the_watchdog_fires_and_not_because_redis_froze(
    fleet: Fleet, worker_env: dict[str, str], frozen_redis: RedisServer, queue_name: str,
):
    """Redis frozen while the device hangs: liveness stays ok until the watchdog fires,
    then fails naming the hung device; the worker exits 3.

    Freezing Redis also holds the hung worker's way out (its last Redis calls
    wait for their time-outs), so the failed ``/livez`` can be seen before it exits.
    """
    port = free_ports(1)
    env = {**worker_env, "TOKENQ_REDIS_URL": frozen_redis.url}
    worker = fleet.start(
        *SIM_FLAGS, *FAST_BEAT, "--sim-hang-s", "3600", "--batch-timeout-s", "2",
        "--metrics-port", str(port), *LOCAL, env=env,
    )
    q = keys.QueueRef(queue_name)
    with redis.Redis.from_url(frozen_redis.url) as admin:
        worker.wait_ready(admin, queue_name)
        wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "/readyz to turn 200")
        admin.xadd(keys.requests(q), {"v": "1", "id": "h", "text": f"{SIM_HANG_MARKER} x"})
        wait_for(lambda: admin.xpending(keys.requests(q), keys.GROUP)["pending"] == 1, 30,
                 "the worker to take the request")
    assert frozen_redis.process is not None
    os.kill(frozen_redis.process.pid, signal.SIGSTOP)

    seen: list[tuple[int, str]] = []

    def hung() -> bool:
        seen.append(get(port, "/livez"))
        return seen[-1][0] == 503 or worker.process.poll() is not None

    wait_for(hung, 30, "/livez to fail")
    status, body = seen[-1]
    assert status == 503 and body.startswith("device hung:") and "batch_timeout_s" in body
    assert all(s == 200 for s, _ in seen[:-1]), seen  # a frozen Redis alone is not fatal
    status, body = get(port, "/readyz")
    assert status == 503 and "device hung" in body
    os.kill(frozen_redis.process.pid, signal.SIGCONT)
    assert worker.process.wait(timeout=30) == 3


def test_a_deregistration_that_fails_without_a_message_logs_the_error_s_type(
    fleet: Fleet, worker_env: dict[str, str], frozen_redis: RedisServer, queue_name: str,
):
    """Redis frozen at SIGTERM: the last calls time out with an empty-message
    ``TimeoutError``, and the warning names it rather than ending in a bare colon."""
    env = {**worker_env, "TOKENQ_REDIS_URL": frozen_redis.url}
    worker = fleet.start(*SIM_FLAGS, *FAST_BEAT, env=env)
    with redis.Redis.from_url(frozen_redis.url) as admin:
        worker.wait_ready(admin, queue_name)
    assert frozen_redis.process is not None
    os.kill(frozen_redis.process.pid, signal.SIGSTOP)
    try:
        worker.terminate(timeout=60)
    finally:
        os.kill(frozen_redis.process.pid, signal.SIGCONT)
    line = next(x for x in worker.output().splitlines() if "could not deregister" in x)
    assert "could not deregister: TimeoutError()" in line, line


def test_readyz_fails_while_every_read_fails_and_recovers_when_one_succeeds(
    fleet: Fleet, r: redis.Redis, redis_url: str, queue_name: str,
):
    """The heartbeat passes while XREADGROUP fails on WRONGTYPE: the worker takes no work,
    so it is not ready; once the key is gone the group is made again and it is ready."""
    port = free_ports(1)
    fleet.start(*SIM_FLAGS, *FAST_BEAT, "--metrics-port", str(port), *LOCAL,
                ready=r, queue=queue_name)
    wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "/readyz to turn 200")
    stream = keys.requests(keys.QueueRef(queue_name))
    with r.pipeline(transaction=True) as swap:  # at once: no read sees the key missing
        swap.delete(stream).set(stream, "not a stream").execute()
    wait_for(lambda: get(port, "/readyz")[0] == 503, 30, "/readyz to fail")
    status, body = get(port, "/readyz")
    assert status == 503 and body.startswith("reads failing: WRONGTYPE"), body
    assert get(port, "/livez") == (200, "ok\n")  # Redis refusing reads is not fatal

    r.delete(stream)
    wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "/readyz to recover")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        assert len(client.infer("taken again", timeout_s=30).embedding) == DIM


def test_readyz_fails_while_the_acl_denies_xreadgroup_and_recovers_when_it_allows_it(
    fleet: Fleet, worker_env: dict[str, str], tmp_path: Path, queue_name: str,
):
    """The documented worker user, then the same rules without ``+xreadgroup`` (it lives in
    a selector, so the user is set again whole): the heartbeat still passes, reads fail
    NOPERM, ``/readyz`` says so; the documented rules again and it is ready again."""
    from tests.faults.test_acl import create_users, documented_rules, user_url

    server = RedisServer(tmp_path / "acl")
    server.start()
    try:
        admin = redis.Redis(port=server.port)
        create_users(admin, queue_name, "pw")
        port = free_ports(1)
        user = f"{queue_name}-worker"
        env = {**worker_env, "TOKENQ_REDIS_URL": user_url(server, user, "pw")}
        fleet.start(*SIM_FLAGS, *FAST_BEAT, "--metrics-port", str(port), *LOCAL, env=env,
                    ready=admin, queue=queue_name)
        wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "/readyz to turn 200")
        rules = documented_rules(queue_name, "pw")["worker"]
        admin.execute_command(*[word.replace(" +xreadgroup", "") for word in rules])
        # Waited for by its reason: on a loaded machine a late heartbeat can make /readyz
        # 503 for a moment for another one, and that is not what this test is about.
        seen: list[tuple[int, str]] = []

        def reads_failing() -> bool:
            seen.append(get(port, "/readyz"))
            return seen[-1][0] == 503 and seen[-1][1].startswith("reads failing: ")

        wait_for(reads_failing, 30, "/readyz to fail on the reads")
        assert "xreadgroup" in seen[-1][1].lower(), seen[-3:]
        assert get(port, "/livez") == (200, "ok\n")
        admin.execute_command(*rules)
        wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "/readyz to recover")
        admin.close()
    finally:
        fleet.close()
        server.stop()


# ------------------------------------------------------------------ the rules


@pytest.mark.unit
def test_reads_failing_on_every_lane_fail_readiness_and_one_answer_restores_it():
    health = Health(heartbeat_s=1.0)
    health.loaded()
    health.running(0.0)
    for lane in (0, 1):
        health.reader_started(lane)
    for _ in range(READ_FAILURES_BEFORE_UNREADY):
        health.read_failed(0, "WRONGTYPE Operation against a key holding the wrong kind")
    assert health.ready(1.0).ok  # lane 1 still takes work
    for _ in range(READ_FAILURES_BEFORE_UNREADY - 1):
        health.read_failed(1, "NOPERM no permissions to run the 'xreadgroup' command")
    assert health.ready(1.0).ok  # one blip less than the rule
    health.read_failed(1, "NOPERM no permissions to run the 'xreadgroup' command")
    verdict = health.ready(1.0)
    assert verdict.text == "reads failing: NOPERM no permissions to run the 'xreadgroup' command"
    assert health.live(1.0).ok
    health.read_ok(0)
    assert health.ready(1.0).ok
    health.read_failed(0, "WRONGTYPE")
    assert health.ready(1.0).ok  # the count starts again after an answer
    health.reader_ended(0)  # a drained lane no longer counts: lane 1 alone fails
    assert health.ready(1.0).text.startswith("reads failing: NOPERM")


@pytest.mark.unit
def test_a_new_worker_is_live_but_not_ready_until_loaded_and_joined():
    health = Health(heartbeat_s=1.0)
    assert health.live(1000.0).ok
    assert health.ready(1000.0).reasons == (MODEL_LOADING,)
    health.loaded()
    assert health.ready(1000.0).reasons == (NOT_JOINED,)
    health.redis_answered(ConnectionError("refused"))
    assert health.ready(1000.0).text == f"{NOT_JOINED}; redis unreachable: refused"
    health.redis_answered()
    health.running(1000.0)
    assert health.ready(1000.0).ok and health.ready(1000.0).text == "ok"
    assert health.live(1002.9).ok  # 3 heartbeats of grace
    assert not health.live(1003.1).ok


@pytest.mark.unit
def test_a_stalled_event_loop_fails_liveness_and_ticks_keep_it_alive():
    health = Health(heartbeat_s=0.5, watchdog_period_s=1.0)  # the slower of the two counts
    health.loaded()
    health.running(0.0)
    for now in (0.9, 1.8, 2.7, 3.6):
        health.tick(now)
        assert health.live(now + 2.9).ok
    verdict = health.live(3.6 + 3.1)
    assert not verdict.ok and verdict.text.startswith("event loop stalled")
    assert "event loop stalled" in health.ready(3.6 + 3.1).text
    health.closed()  # a worker on its way out is not expected to tick
    assert health.live(100.0).ok and health.ready(100.0).reasons == (STOPPING,)


@pytest.mark.unit
def test_a_heartbeat_waiting_on_redis_fails_readiness_not_liveness():
    health = Health(heartbeat_s=1.0)
    health.loaded()
    health.running(0.0)
    health.beat_started(10.0)
    health.tick(12.0)  # the watchdog still ticks: the loop runs
    assert health.ready(12.5).ok
    verdict = health.ready(13.5)
    assert verdict.text == "redis unreachable: no answer for 3.5s"
    assert health.live(13.5).ok
    health.beat_finished(TimeoutError("Timeout reading from socket"))
    assert health.ready(13.6).text == "redis unreachable: Timeout reading from socket"
    health.beat_started(14.0)
    health.beat_finished()
    assert health.ready(14.1).ok


@pytest.mark.unit
def test_the_watchdog_and_a_stop_fail_the_right_probes():
    health = Health(heartbeat_s=1.0)
    health.loaded()
    health.running(0.0)
    health.stopping = True
    assert health.live(0.5).ok and health.ready(0.5).reasons == (STOPPING,)
    health.stage_hung("device", "a batch of 3 requests on the device for more than 5s")
    assert health.live(0.5).text == (
        "device hung: a batch of 3 requests on the device for more than 5s")
    assert "device hung" in health.ready(0.5).text
