"""An example web backend: FastAPI in front of a tokenq queue.

The web process holds no model: it enqueues through one shared
:class:`tokenq.producer.AsyncClient` (all waits multiplexed on one reply key)
and GPU workers elsewhere answer. Run it with any ASGI server::

    pip install tokenq fastapi uvicorn
    TOKENQ_REDIS_URL=redis://localhost:6379/0 TOKENQ_QUEUE=embed \\
        uvicorn scripts.fastapi_app:app --port 8000
    curl -s localhost:8000/embed -H 'content-type: application/json' \\
        -d '{"texts": ["hello", "world"]}'

Errors map to HTTP the way a caller can act on them: a bad input is 422, a
full queue 503 (retry later), Redis down 503, no answer in time 504, a
worker's error 502 with its code, and a queue whose model answers scores
(a classifier or a reranker) rather than embeddings 409, naming the task.

This is a minimal example of embedding the client in one's own app, and
serves embedding queues only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from tokenq.producer import (
    AsyncClient,
    BadRequest,
    BrokerUnavailable,
    DeadlineExceeded,
    QueueFull,
    RemoteError,
    ReplyTimeout,
)
from tokenq.shared.settings import ClientSettings


class EmbedRequest(BaseModel):
    texts: list[str] = Field(min_length=1, max_length=1024)
    timeout_s: float = Field(10.0, gt=0, le=120)


class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    dim: int
    tokens: list[int | None]


def create_app(settings: ClientSettings | None = None) -> FastAPI:
    """The app; settings default to ``TOKENQ_*`` from the environment."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncClient(settings=settings or ClientSettings()) as client:
            app.state.tokenq = client
            yield

    app = FastAPI(title="tokenq embeddings", lifespan=lifespan)

    @app.post("/embed", response_model=EmbedResponse)
    async def embed(body: EmbedRequest) -> EmbedResponse:
        client: AsyncClient = app.state.tokenq
        try:
            results = await client.infer_many(body.texts, timeout_s=body.timeout_s)
        except BadRequest as exc:
            raise HTTPException(422, str(exc)) from exc
        except (QueueFull, BrokerUnavailable) as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from exc
        except (ReplyTimeout, DeadlineExceeded) as exc:
            raise HTTPException(504, str(exc)) from exc
        except RemoteError as exc:
            raise HTTPException(502, {"code": exc.code, "message": exc.message}) from exc
        if any(result.embedding is None for result in results):
            raise HTTPException(
                409,
                f"queue {client.queue!r} answers scores (a classifier or reranker model), "
                "not embeddings; this app serves embedding queues only",
            )
        vectors = [list(result.embedding) for result in results]
        return EmbedResponse(
            embeddings=vectors,
            dim=len(vectors[0]) if vectors else 0,
            tokens=[result.tokens for result in results],
        )

    @app.get("/healthz")
    async def healthz() -> dict[str, int]:
        client: AsyncClient = app.state.tokenq
        try:
            return {"queue_length": await client.queue_length()}
        except BrokerUnavailable as exc:
            raise HTTPException(503, str(exc)) from exc

    return app


app = create_app()
