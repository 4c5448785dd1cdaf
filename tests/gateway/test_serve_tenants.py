"""The gateway's tenants: each of ``--api-keys`` names its caller's tenant, which no header can
change; without them ``X-Tokenq-Tenant`` names it; a bad name is a clear 400."""

from __future__ import annotations

import pytest

from tokenq.shared import keys

pytest_plugins = ("tests.cli_fixtures",)

pytest.importorskip("fastapi.testclient")
from tests.gateway.test_serve import assert_vectors, gateway  # noqa: E402  (after the skip)

BODY = {"model": "m", "input": ["a tenant's text"]}


def streams(r, queue: str) -> set[bytes]:
    return r.smembers(keys.tenants(keys.QueueRef(queue)))


def test_an_api_key_names_its_tenant_and_a_header_cannot_pick_another(
        sim_worker, redis_url, r, queue_name):
    sim_worker()
    q = keys.QueueRef(queue_name)
    with gateway(redis_url, queue_name, api_keys="team-a=key-a,team-b=key-b") as http:
        answered = http.post("/v1/embeddings", json=BODY,
                             headers={"Authorization": "Bearer key-a"})
        assert answered.status_code == 200, answered.text
        assert_vectors([answered.json()["data"][0]["embedding"]], BODY["input"])
        assert streams(r, queue_name) == {keys.tenant_requests(q, "team-a").encode()}
        # The same tenant named again is fine; another one is refused, nothing written.
        same = http.post("/v1/embeddings", json=BODY, headers={
            "Authorization": "Bearer key-a", "X-Tokenq-Tenant": "team-a"})
        assert same.status_code == 200, same.text
        forged = http.post("/v1/embeddings", json=BODY, headers={
            "Authorization": "Bearer key-a", "X-Tokenq-Tenant": "team-b"})
        assert forged.status_code == 403
        assert forged.json()["error"]["param"] == "X-Tokenq-Tenant"
        assert forged.json()["error"]["code"] == "forbidden_tenant"
        for wrong in ({}, {"Authorization": "Bearer team-a"}, {"Authorization": "Bearer key-"}):
            assert http.post("/v1/embeddings", json=BODY, headers=wrong).status_code == 401
        assert http.get("/health").status_code == 200  # probes stay open
    assert streams(r, queue_name) == {keys.tenant_requests(q, "team-a").encode()}
    assert r.xlen(keys.tenant_requests(q, "team-b")) == 0


def test_without_api_keys_the_header_names_the_tenant_and_a_bad_name_is_a_400(
        sim_worker, redis_url, r, queue_name):
    sim_worker()
    q = keys.QueueRef(queue_name)
    with gateway(redis_url, queue_name, api_key="shared") as http:
        auth = {"Authorization": "Bearer shared"}
        named = http.post("/embed", json={"inputs": "tei's route"},
                          headers={**auth, "X-Tokenq-Tenant": "team-x"})
        assert named.status_code == 200, named.text
        assert streams(r, queue_name) == {keys.tenant_requests(q, "team-x").encode()}
        for bad in ("a b", "x" * 65, "a:b", "é"):
            refused = http.post("/v1/embeddings", json=BODY,
                                headers={**auth, "X-Tokenq-Tenant": bad.encode()})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "X-Tokenq-Tenant" and "is invalid" in error["message"]
        plain = http.post("/v1/embeddings", json=BODY, headers=auth)
        assert plain.status_code == 200, plain.text
    assert streams(r, queue_name) == {keys.tenant_requests(q, "team-x").encode()}


def test_a_bad_api_keys_setting_is_refused_without_showing_the_key():
    from tokenq.shared.settings import ServeSettings

    with pytest.raises(ValueError, match="part 1 is not tenant=key") as refused:
        ServeSettings(api_keys="sekrit")
    assert "sekrit" not in str(refused.value)


def test_a_tenant_over_its_streams_limit_gets_a_429_naming_it_and_others_flow(
        sim_worker, redis_url, r, queue_name):
    sim_worker()
    with gateway(redis_url, queue_name, api_keys="team-a=key-a,team-b=key-b",
                 max_queue_length=2) as http:
        a = {"Authorization": "Bearer key-a"}
        full = http.post("/v1/embeddings", json={"model": "m", "input": ["1", "2", "3"]},
                         headers=a)
        assert full.status_code == 429 and full.headers["Retry-After"]
        assert "tenant 'team-a'" in full.json()["error"]["message"]
        fine = http.post("/v1/embeddings", json={"model": "m", "input": ["b's", "two"]},
                         headers={"Authorization": "Bearer key-b"})
        assert fine.status_code == 200, fine.text


def test_a_tenant_over_its_quota_gets_a_429_naming_it_and_others_flow(
        sim_worker, redis_url, r, queue_name):
    """docs/OPERATIONS.md, "Quotas": a paused tenant (quota 0) is told to retry later; one
    request over a cap alone is a 422 that says it can never be queued."""
    sim_worker()
    q = keys.QueueRef(queue_name)
    r.hset(keys.quotas(q), mapping={"team-a": 0, "team-c": 3})
    with gateway(redis_url, queue_name, api_keys="team-a=key-a,team-b=key-b,team-c=key-c") as http:
        over = http.post("/v1/embeddings", json=BODY, headers={"Authorization": "Bearer key-a"})
        assert over.status_code == 429 and over.headers["Retry-After"], over.text
        error = over.json()["error"]
        assert error["code"] == "quota_exceeded" and "tenant 'team-a'" in error["message"]
        assert "quota of 0" in error["message"]
        fine = http.post("/v1/embeddings", json=BODY, headers={"Authorization": "Bearer key-b"})
        assert fine.status_code == 200, fine.text
        alone = http.post("/v1/embeddings", json=BODY, headers={"Authorization": "Bearer key-c"})
        assert alone.status_code == 422 and "can never be queued" in alone.text, alone.text
    assert r.xlen(keys.tenant_requests(q, "team-a")) == 0
