"""The ingress deployment: every HTTP request comes here and goes on to a replica (the router picks
which), and its answer comes back as the replica's app wrote it. The ingress itself answers only
what spans replicas: /health, /metrics, /slots and the live page."""
import json
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from ..server.bodies import MAX_BODY_BYTES
from ..server.errors import error_body
from ..server.front import PAGE, RETRY_AFTER_S, WRONG_KEY, key_matches
from . import metrics, router
from .asgi import Forwarded, Start, routing_text

STALE_S = 5.0  # a replica that has not reported for this long is gone (its restart reports anew)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]

api = FastAPI(title="specee", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(HTTPException)
async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code, headers=e.headers)


def replica_failed(e: Exception) -> dict:
    return error_body(f"the replica serving this request stopped ({type(e).__name__}); retry", "server_error",
                      code="replica_failed")


async def read_body(request: Request) -> bytes | Response:
    """The body, up to the replicas' limit (they answer the same 413 for a body between)."""
    too_large = JSONResponse(error_body(f"the body is over {MAX_BODY_BYTES} bytes", "invalid_request_error",
                                        code="body_too_large"), status_code=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            return too_large
    return bytes(body)


@serve.ingress(api)
class Ingress:
    # No `from __future__ import annotations` in this module: FastAPI reads the routes' annotations
    # (Request) as objects, and Ray Serve's class-based routes do not resolve them from strings.
    def __init__(self, replicas: DeploymentHandle, api_key: str | None = None) -> None:
        self.replicas = replicas.options(stream=True)
        self.api_key = api_key
        self.reports: dict[str, tuple[float, dict]] = {}
        self.registry = CollectorRegistry()
        self.failures = Counter("specee_replica_failures", "Requests whose replica stopped before answering "
                                "them whole (streams end with an error event)", registry=self.registry)
        Gauge("specee_replicas", "Replicas that reported in the last few seconds",
              registry=self.registry).set_function(lambda: len(self.live()))
        self.page = PAGE.read_text()

    async def report(self, snapshot: dict) -> None:
        """A replica's metrics and slots, every second or so."""
        self.reports[snapshot["replica"]] = (time.monotonic(), snapshot)

    def live(self) -> list[dict]:
        now = time.monotonic()
        for replica, (at, _) in list(self.reports.items()):
            if now - at > STALE_S:
                del self.reports[replica]
        return [snapshot for _, snapshot in sorted(self.reports.values(), key=lambda r: r[1]["replica"])]

    @api.get("/", include_in_schema=False)
    async def live_page(self) -> HTMLResponse:
        return HTMLResponse(self.page)

    @api.get("/health")
    async def health(self) -> JSONResponse:
        live = self.live()
        body = {"status": "ok" if live else "no replica", "queued": sum(r["queued"] for r in live),
                "running": sum(r["running"] for r in live),
                "replicas": [{k: r[k] for k in ("replica", "pid", "queued", "running")} for r in live]}
        return JSONResponse(body, status_code=200 if live else 503)

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        expositions = {r["replica"]: r["metrics"] for r in self.live()}
        return Response(metrics.exposition(expositions, self.registry, router.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @api.get("/slots")
    async def slots(self, request: Request) -> JSONResponse:
        if not key_matches(request, self.api_key):
            return JSONResponse(error_body(WRONG_KEY, "invalid_request_error", code="invalid_api_key"),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        live = self.live()
        return JSONResponse({"max_batch": sum(r["max_batch"] for r in live), "queued": sum(r["queued"] for r in live),
                             "slots": [slot for r in live for slot in r["slots"]]})

    @api.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def forward(self, request: Request, path: str) -> Response:
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        forwarded = Forwarded(request.method, request.url.path, request.url.query.encode(),
                              list(request.scope["headers"]), body, routing_text(request.url.path, body))
        answer = self.replicas.forward.remote(forwarded)
        try:
            start: Start = await answer.__anext__()
        except RayError as e:
            self.failures.inc()
            return JSONResponse(replica_failed(e), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower() != b"content-length"}
        if (start.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return StreamingResponse(self.relay(answer), status_code=start.status, headers=headers)
        try:
            content = b"".join([chunk async for chunk in answer])
        except RayError as e:
            self.failures.inc()
            return JSONResponse(replica_failed(e), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return Response(content, status_code=start.status, headers=headers)

    async def relay(self, answer) -> AsyncIterator[bytes]:
        """A stream's events as they come; if its replica stops, an error event and [DONE], as the
        plain server ends a stream that fails, so no client takes it for a finished answer."""
        try:
            async for chunk in answer:
                yield chunk
        except RayError as e:
            self.failures.inc()
            yield f"data: {json.dumps(replica_failed(e))}\n\ndata: [DONE]\n\n".encode()
        finally:
            answer.cancel()  # the client left: the replica's app sees a disconnect and stops the work

