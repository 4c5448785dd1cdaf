"""What is checked of a request before any route sees it (CORS, API keys, tenants, the
``Content-Type``, unknown routes), and uvicorn's header timeout (docs/SECURITY.md)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenq.producer.serve.errors import ApiError, body_for
from tokenq.shared.keys import check_tenant
from tokenq.shared.settings import ServeSettings, tenant_keys

log = logging.getLogger("tokenq.serve")

TENANT_HEADER = b"x-tokenq-tenant"
"""Names the request's tenant, honoured unless the caller's API key names another."""
CACHE_HEADER = b"x-tokenq-cache"
"""``false``: every request of the call is computed afresh (the request option ``cache``)."""
OPEN_PATHS = frozenset({"/health", "/livez", "/ready", "/readyz", "/metrics", "/ping"})
"""Routes answered without ``--api-key``: probes and the Prometheus scrape."""

def error_response(path: str, error: ApiError) -> JSONResponse:
    """``error`` in the shape of the API family ``path`` belongs to."""
    return JSONResponse(body_for(path)(error), status_code=error.status, headers=error.headers)


async def unrouted(request: Request, exc: HTTPException) -> JSONResponse:
    """The router's 404 (no route has the path) and 405 (its route takes other methods)."""
    method, path = request.method, request.url.path
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        error = ApiError(404, f"Invalid URL ({method} {path}): no route of this gateway "
                         "serves it; GET /openapi.json lists them", code="not_found")
    elif exc.status_code == 405:
        error = ApiError(405, f"Method {method} is not allowed on {path}; it answers "
                         f"{headers.get('Allow', 'other methods')}",
                         code="method_not_allowed", headers=headers)
    else:
        error = ApiError(exc.status_code, str(exc.detail), headers=headers)
    return error_response(path, error)


class Edge:
    """Steps 2-4 of the module's list, as plain ASGI (no body buffering, no task per call)."""

    def __init__(self, app: ASGIApp, api_key: str | None, api_keys: str = "") -> None:
        self.app = app
        self.tenants: dict[bytes, str | None] = {
            f"Bearer {key}".encode(): tenant for key, tenant in tenant_keys(api_keys).items()}
        """Each accepted ``Authorization`` value and the tenant it names (None: any)."""
        if api_key is not None:
            self.tenants.setdefault(f"Bearer {api_key}".encode(), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            await error_response(scope["path"], refusal)(scope, receive, send)
            return
        started = time.monotonic()
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, watch)
        if status == 499:
            log.warning("client went away: %s %s after %.2f s (499)", scope["method"],
                     scope["path"], time.monotonic() - started)

    def refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope["headers"])
        tenant, open_path = None, scope["path"] in OPEN_PATHS
        if self.tenants and not open_path:
            given = headers.get(b"authorization", b"")
            matches = [named for expected, named in self.tenants.items()
                       if hmac.compare_digest(given, expected)]
            if not matches:
                return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer "
                                "<key>' (--api-key, --api-keys)", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
            tenant = matches[0]
        asked = None if open_path else headers.get(TENANT_HEADER)
        if asked is not None:
            text = asked.decode("latin-1")
            try:
                check_tenant(text)
            except ValueError as exc:
                return ApiError(400, str(exc), param="X-Tokenq-Tenant", code="invalid_tenant")
            if tenant is not None and text != tenant:
                return ApiError(403, "X-Tokenq-Tenant names another tenant than the API key's "
                                "(--api-keys): a key's tenant cannot be chosen by the caller",
                                param="X-Tokenq-Tenant", code="forbidden_tenant")
            tenant = text
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
        cache = headers.get(CACHE_HEADER)
        if cache is not None and not open_path:
            flag = cache.decode("latin-1").strip().lower()
            if flag not in ("true", "false"):
                return ApiError(400, "X-Tokenq-Cache must be true or false", param="X-Tokenq-Cache",
                                code="invalid_cache")
            scope.setdefault("state", {})["cache"] = flag == "true"
        content_type = headers.get(b"content-type")
        if scope["method"] == "POST" and content_type is not None:
            text = content_type.decode("latin-1")
            media = text.split(";", 1)[0].strip().lower()  # application/json or /<x>+json
            if media != "application/json" and not (media.startswith("application/")
                                                    and media.endswith("+json")):
                return ApiError(415, f"Content-Type {text!r} is not served: send "
                                "application/json", param="Content-Type",
                                code="unsupported_media_type")
        return None


def install(app: FastAPI, settings: ServeSettings) -> None:
    """The edge's middleware and unknown-route answers on ``app`` (added last runs first:
    CORS is outermost)."""
    app.add_exception_handler(HTTPException, unrouted)  # type: ignore[arg-type]
    app.add_middleware(Edge, api_key=settings.api_key, api_keys=settings.api_keys)
    origins = [item.strip() for item in settings.cors_allow_origin.split(",") if item.strip()]
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection that sends no complete request head within
    ``timeout_s`` of opening or of its last answer (slowloris; uvicorn times out only idle ones)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the head is in: the body has --timeout-s

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                log.info("closed a connection that sent no request head within %s s "
                         "(--header-timeout-s)", timeout_s)
                self.transport.close()

    return HeaderTimeout
