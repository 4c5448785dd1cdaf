"""The gateway's app: OpenAI, TEI, Cohere and probe routes over one AsyncClient per queue
(docs/OPERATIONS.md, "tokenq serve"); a client that leaves cancels its request's wait."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tokenq.producer import AsyncClient, Result
from tokenq.producer.serve import (
    delivery,
    edge,
    openai_api,
    openapi,
    render,
    schemas,
    tei_api,
)
from tokenq.producer.serve.bounds import Admission, Parser, check_job, read_body
from tokenq.producer.serve.errors import ApiError, from_exception
from tokenq.producer.serve.schemas import Job
from tokenq.shared.cli import version
from tokenq.shared.failures import error_text
from tokenq.shared.keys import QueueRef
from tokenq.shared.queue_config import QueueConfig, parse_config
from tokenq.shared.settings import ServeSettings

log = logging.getLogger("tokenq.serve")
PENDING_EVERY_S = 5.0
"""How often the gateway reads each queue's pending tokens for its gauge."""
DISCONNECT_POLL_S = 0.1  # how often a waiting route checks whether its client is still there

Check = Callable[[QueueConfig | None, str, Job], None]
"""Refuses a job before it is sent when the queue's config says its model cannot answer it."""
Answer = Callable[[list[Result], Any, str, QueueConfig | None], Any]
"""The answer of ``(results, body, model, config)``, built off the event loop."""
T = TypeVar("T")


class Gateway:
    """The per-queue clients and the metrics: what every route shares."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.models = settings.model_queues
        self.queues = sorted(set(self.models.values()) or {settings.queue})
        self.clients: dict[str, AsyncClient] = {}
        self.admission = Admission(settings.max_concurrent_requests)
        self.parser = Parser()
        self.reachability = delivery.Reachability()
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenq_serve_requests", "HTTP requests answered, by route and "
                                "status", ["route", "status"], registry=self.registry)
        self.inputs = Counter("tokenq_serve_inputs", "texts sent to queues, by queue", ["queue"],
                              registry=self.registry)
        self.seconds = Histogram("tokenq_serve_request_seconds", "time to answer an HTTP request, "
                                 "by route", ["route"], registry=self.registry)
        Gauge("tokenq_serve_in_flight", "POST requests in flight (at most "
              "--max-concurrent-requests)", registry=self.registry,
              ).set_function(lambda: self.admission.in_flight)
        self.registry.register(_Unreplicated(self.clients))
        self.pending = Gauge("tokenq_queue_pending_tokens", "The queue's pending tokens, every "
                             "tenant's (read every few seconds, also while no worker runs: what "
                             "KEDA wakes the workers from zero on)", ["queue"],
                             registry=self.registry)

    async def watch_pending(self) -> None:
        """Keep ``tokenq_queue_pending_tokens`` fresh, every :data:`PENDING_EVERY_S`; a Redis
        that does not answer (or refuses ``HGET``) leaves the last figure, or none, logged once
        until a refresh works again."""
        failing: set[str] = set()
        while True:
            for queue, client in self.clients.items():
                try:
                    self.pending.labels(queue).set(
                        await client.pending_tokens(timeout_s=PENDING_EVERY_S))
                except Exception as exc:
                    if queue not in failing:
                        log.warning("cannot refresh tokenq_queue_pending_tokens of queue %r "
                                    "(%s); it keeps its last figure", queue, error_text(exc))
                    failing.add(queue)
                else:
                    failing.discard(queue)
            await asyncio.sleep(PENDING_EVERY_S)

    def queue_of(self, model: str | None) -> str:
        """The queue serving ``model``; 404 for a name ``--models`` does not list."""
        if not self.models:
            return self.settings.queue
        if model is None:
            return next(iter(self.models.values()))
        queue = self.models.get(model)
        if queue is None:
            raise ApiError(404, f"The model {model!r} does not exist; served: "
                           f"{', '.join(self.models)}", param="model", code="model_not_found")
        return queue

    def default_model(self) -> str:
        return next(iter(self.models), None) or self.settings.queue

    async def ask(self, queue: str, call: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
        """``call`` of the queue's client, ended by a 503 as soon as the probe finds its Redis
        gone (delivery.Reachability)."""
        client = self.clients[queue]
        return await self.reachability.watch(queue, client, asyncio.ensure_future(call(client)))

    async def config(self, queue: str) -> QueueConfig | None:
        """The queue's config hash as its workers published it (None before any started)."""
        return parse_config(await self.ask(queue, AsyncClient.config))

    async def read(self, request: Request, prepare: Callable[[bytes], T]) -> T:
        """``prepare`` (module-level: it may run in a child process) of the request's body, read
        within the bounds."""
        raw = await read_body(request, self.settings.max_body_bytes, self.settings.timeout_s)
        request.state.body_bytes = len(raw)
        if delivery.HEADER in request.headers:
            request.state.body_digest = delivery.body_digest(raw)
        return await self.parser.run(raw, prepare)

    async def infer(self, request: Request, queue: str, job: Job) -> list[Result]:
        """``infer_many`` of ``job`` on ``queue`` within the bounds, cancelled if the client goes
        away; under an ``Idempotency-Key`` it first claims its answer (:class:`.delivery.Claim`)."""
        check_job(job.items, job.options, job.where, request.state.body_bytes,
                  self.settings.max_client_batch_size)
        self.inputs.labels(queue).inc(len(job.items))
        tenant = getattr(request.state, "tenant", None)  # set by the edge (--api-keys, header)
        if tenant is not None:
            job.options["tenant"] = tenant
        if getattr(request.state, "cache", None) is False:  # X-Tokenq-Cache: false
            job.options["cache"] = False
        key = request.headers.get(delivery.HEADER)
        unique = None if key is None else delivery.request_ids(
            key, queue, request.state.body_digest, len(job.items))
        claim = None
        if key is not None and unique is not None and self.settings.dedupe_ttl_s > 0:
            claim = await watched(request, self.ask(queue, lambda client: delivery.claim(
                client, QueueRef(queue, self.settings.prefix), key,
                request.url.path, request.state.body_digest, unique,
                window_s=self.settings.dedupe_ttl_s, timeout_s=self.settings.timeout_s,
                max_bytes=self.settings.max_body_bytes)))
            delivery.current.set(claim)  # answer() stores what the route answers
        try:
            return await watched(request, delivery.deliver(
                self.clients[queue], queue, job, timeout_s=self.settings.timeout_s,
                cold_start_s=self.settings.cold_start_s, reachability=self.reachability,
                unique=unique, keep=claim is not None,
            ))
        except Exception as exc:
            raise from_exception(exc, job.options, job.where) from exc

    async def answer(
        self, route: str, work: Callable[[], Awaitable[Any]], admit: bool = False
    ) -> Response:
        """Run a route's work; every failure in the shape of the route's API family. ``admit``:
        it counts against ``--max-concurrent-requests`` (POST routes; never the probes)."""
        started = time.perf_counter()
        claimed = delivery.current.set(None)
        try:
            with self.admission.admit() if admit else nullcontext():
                value = await work()  # built, if render.Later, and encoded off the event loop
                later = value if isinstance(value, render.Later) else render.Later(lambda: value)
                data = await asyncio.to_thread(lambda: render.encode(later.fn(*later.args)))
                response = Response(data, media_type="application/json", headers=later.headers)
                await _keep_answer(response)
        except delivery.Replay as replay:
            response = Response(replay.body, status_code=replay.status,
                                media_type="application/json",
                                headers={"Idempotent-Replayed": "true"})
        except Exception as exc:  # mapped, or re-raised by from_exception if it is a bug
            response = edge.error_response(route, from_exception(exc))
            await _keep_answer(response)
        finally:
            delivery.current.reset(claimed)
        self.requests.labels(route, str(response.status_code)).inc()
        self.seconds.labels(route).observe(time.perf_counter() - started)
        return response

    async def serve(self, request: Request, route: str, prepare: Callable[[bytes], Any],
                    check: Check, answer: Answer,
                    headers: Callable[[list[Result]], dict[str, str]] | None = None) -> Response:
        """A route that sends its body's job to a queue: ``check`` the queue's config before
        anything is sent, then ``answer`` the results, sent with their ``headers``."""
        async def work() -> render.Later:
            body, job = await self.read(request, prepare)
            queue = self.queue_of(body.model)
            model = body.model or self.default_model()
            config = await self.config(queue)
            check(config, model, job)
            results = await self.infer(request, queue, job)
            return render.Later(answer, results, body, model, config,
                                headers=headers(results) if headers else None)
        return await self.answer(route, work, admit=True)

    async def health(self) -> Response:
        """``GET /health``: each queue's length while its Redis answers."""
        async def work() -> dict[str, Any]:
            lengths = {q: await self.ask(q, AsyncClient.queue_length) for q in self.queues}
            return {"status": "ok", "queue_lengths": lengths}
        return await self.answer("/health", work)


async def _keep_answer(response: Response) -> None:
    """Store a 200 under the request's Idempotency-Key (if it claimed one); free its lease."""
    claim = delivery.current.get()
    if claim is None:
        return
    delivery.current.set(None)
    if response.status_code == 200:
        await claim.store(response.status_code, bytes(response.body))
    await claim.release()


async def watched(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, cancelled with a 499 if the HTTP client goes away meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "the client went away", code="client_closed")
    finally:
        task.cancel()  # a no-op once it is done


class _Unreplicated(Collector):
    """``tokenq_serve_unreplicated_requests_total``, read from the clients at each scrape."""

    def __init__(self, clients: dict[str, AsyncClient]) -> None:
        self._clients = clients

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("tokenq_serve_unreplicated_requests", "requests written by a "
                                     "durable enqueue that too few replicas confirmed, by queue",
                                     labels=["queue"])
        for queue, client in self._clients.items():
            family.add_metric([queue], client.unreplicated)
        yield family


def create_app(settings: ServeSettings) -> FastAPI:
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for queue in gateway.queues:
                client = AsyncClient(settings=settings.model_copy(update={"queue": queue}))
                gateway.clients[queue] = await stack.enter_async_context(client)
            stack.callback(gateway.parser.close)
            announce = asyncio.ensure_future(gateway.reachability.announce(gateway.clients))
            stack.callback(announce.cancel)
            stack.callback(asyncio.ensure_future(gateway.watch_pending()).cancel)
            yield

    app = FastAPI(title="tokenq serve", version=version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    edge.install(app, settings)

    for module in (openai_api, tei_api):
        app.include_router(module.router)

    @app.get("/info")
    async def info() -> Response:
        async def work() -> dict[str, Any]:
            queue = gateway.queue_of(None)
            config = await gateway.config(queue) or QueueConfig()
            return {
                "model_id": config.model or gateway.default_model(),
                "served_model_name": gateway.default_model(),
                "model_sha": None,
                "model_dtype": config.dtype,
                "model_type": schemas.tei_model_type(config),
                "max_input_length": config.max_input_tokens,
                "max_batch_tokens": config.max_batch_tokens,
                "max_client_batch_size": settings.max_client_batch_size,
                "max_concurrent_requests": settings.max_concurrent_requests,
                "tokenization_workers": config.tokenize_processes,
                "auto_truncate": config.policy == "truncate",
                "version": version(),
                "queue": queue,
                "models": gateway.models or {gateway.default_model(): queue},
            }
        return await gateway.answer("/info", work)

    @app.get("/health")
    @app.get("/livez")  # the worker's name for its liveness probe: one probe config for both
    @app.get("/ping")  # TEI's (SageMaker's)
    async def health() -> Response:
        return await gateway.health()

    @app.get("/ready")
    @app.get("/readyz")  # the worker's name
    async def ready() -> Response:
        async def work() -> dict[str, Any]:
            alive = {q: await gateway.ask(q, AsyncClient.workers_alive) for q in gateway.queues}
            idle = [q for q, count in alive.items() if not count]
            if idle:
                raise ApiError(503, f"no live worker serves queue(s) {', '.join(idle)}",
                               code="no_worker")
            return {"status": "ready", "workers": alive}
        return await gateway.answer("/ready", work)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    openapi.describe(app)
    return app
