"""The FastAPI app: OpenAI-compatible routes over one engine, the live page, health and metrics.
Handlers validate, submit a Job to the scheduler and relay what its worker delivers."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..batch import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, Batch
from ..engine import Engine, Event, Result
from ..options import LoadOptions, flag
from .bodies import ClientGone, read_json
from .completions import Defaults, Planner, Shaper, check_token_ids, prompts_of
from .errors import BadRequest, error_body
from .front import PAGE, RETRY_AFTER_S, WRONG_KEY, key_matches
from .metrics import Metrics
from .inbox import Inbox
from .scheduler import Ended, Job, QueueFull, Scheduler
from .schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
# After SIGTERM, how long running requests may take to finish (--shutdown-grace); those still
# running SHUTDOWN_MARGIN_S before the end get an error event and [DONE] instead.
GRACEFUL_SHUTDOWN_S = 30
SHUTDOWN_MARGIN_S = 1.0
BODY_TIMEOUT_S = 30  # a request's whole body must arrive in this long (--body-timeout)
KEEP_ALIVE_S = 5  # uvicorn's default: an idle connection, new or between requests, is closed after it

log = logging.getLogger("uvicorn.error")  # uvicorn's configured logger: its lines and ours in one stream
# Why a generation ended early -> (HTTP status, error type, code).
FAILURES = {
    "timeout": (504, "timeout_error", "request_timeout"),
    "shutdown": (503, "server_error", "shutting_down"),
    "error": (500, "server_error", "generation_failed"),
    "grammar": (400, "invalid_request_error", "grammar_failed"),  # the request's grammar gave up mid-answer
    "cancelled": (499, "invalid_request_error", "client_closed_request"),  # nobody reads it: the client left
}


@dataclass
class ServerConfig:
    model_id: str
    defaults: Defaults
    api_key: str | None = None
    max_queue: int = 64
    request_timeout: float = 300.0
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK
    body_timeout: float = BODY_TIMEOUT_S
    keep_alive: float = KEEP_ALIVE_S
    shutdown_grace: float = GRACEFUL_SHUTDOWN_S


def model_id_of(engine: Engine) -> str:
    """What /v1/models calls the served model: a file's stem or a directory's name."""
    source = engine.source
    return source.stem if source and source.is_file() else (source.name if source else "specee")


def failure(ended: Ended) -> BadRequest:
    status, kind, code = FAILURES[ended.outcome]
    return BadRequest(ended.message, code=code, status=status, kind=kind)


class CountRequests:
    """ASGI middleware: counts every response by route and status (unknown paths as "other", so
    a scan of random URLs cannot grow the metrics without bound)."""

    def __init__(self, app, metrics: Metrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    metrics = Metrics(engine.cpu_tier)
    scheduler = Scheduler(Batch(engine.model, config.prefill_chunk), config.max_queue, config.max_batch,
                          on_step=metrics.record_step, on_end=metrics.record_end, on_pass=metrics.record_pass)
    metrics.watch(scheduler, engine.prefix_cache, engine.suffix_cache, lambda: engine.pass_threads)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specee", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler  # serve() drains it on SIGTERM
    app.state.metrics = metrics  # a cluster replica reports them to its ingress
    add_error_handlers(app)
    add_status_routes(app, scheduler, metrics, config)
    add_generation_routes(app, engine, scheduler, config)
    add_tokenizer_routes(app, engine, config)
    routes = {route.path for route in app.routes}
    app.add_middleware(CountRequests, metrics=metrics, routes=routes)
    return app


def key_required(config: ServerConfig) -> Callable:
    """The dependency of the routes behind the API key."""
    async def require_key(request: Request) -> None:
        if not key_matches(request, config.api_key):
            raise BadRequest(WRONG_KEY, code="invalid_api_key", status=401)
    return require_key


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, e: BadRequest) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if e.status == 503:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s hung up before sending the whole request to %s", client, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message, code = str(e.detail), None
        if e.status_code == 404:  # no route: say so plainly (e.g. /v1/embeddings, which OpenAI serves)
            message, code = f"specee does not serve {request.url.path}", "unknown_route"
        elif e.status_code == 405:
            message, code = f"{request.url.path} does not take {request.method}", "method_not_allowed"
        return JSONResponse(error_body(message, "invalid_request_error", None, code), status_code=e.status_code,
                            headers=e.headers)


def add_status_routes(app: FastAPI, scheduler: Scheduler, metrics: Metrics, config: ServerConfig) -> None:
    """The live page, health, slots, metrics and the model list."""
    page = PAGE.read_text()
    keyed = [Depends(key_required(config))]

    @app.get("/", include_in_schema=False)
    async def live_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "queued": scheduler.queued, "running": scheduler.running}

    @app.get("/slots", dependencies=keyed)
    async def slots() -> dict:
        """Every running generation (llama.cpp's server has the same route): the live page polls it."""
        return {"max_batch": config.max_batch, "queued": scheduler.queued, "slots": scheduler.slots()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_id, "object": "model", "created": 0,
                                            "owned_by": "specee"}]}


def add_generation_routes(app: FastAPI, engine: Engine, scheduler: Scheduler, config: ServerConfig) -> None:
    """The completions."""
    planner = Planner(engine, config.defaults)
    keyed = [Depends(key_required(config))]

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request):
        return await complete(request, parse(ChatRequest, await read_json(request, config.body_timeout)))

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request):
        return await complete(request, parse(CompletionRequest, await read_json(request, config.body_timeout)))

    async def complete(request: Request, body: ChatRequest | CompletionRequest):
        check_model(body.model, config)
        prompts = prompts_of(engine, body)
        generations = []
        for prompt in prompts:  # each prompt's n choices share its prefill
            generation = planner.generation(body, prompt)
            generations += [generation] + (generation.followers(body.n - 1) if body.n > 1 else [])
        inbox = Inbox(len(generations), streamed=body.stream)
        deadline = time.monotonic() + config.request_timeout
        jobs = [Job(g, deadline, inbox.deliverer(i)) for i, g in enumerate(generations)]
        try:
            for job in jobs:
                scheduler.submit(job)
        except QueueFull as e:
            for job in jobs:
                job.cancel()
            raise BadRequest(f"{e}; retry later", code="queue_full", status=503, kind="server_error") from None
        shaper = Shaper(isinstance(body, ChatRequest), config.model_id, engine, prompts, body.n)
        if body.stream:
            return StreamingResponse(told_on_failure(stream(jobs, inbox, shaper, body.include_usage)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(shaper.whole(await collect(request, jobs, inbox)))


def add_tokenizer_routes(app: FastAPI, engine: Engine, config: ServerConfig) -> None:
    """The tokenizer's routes, as llama-server and vLLM serve them."""
    keyed = [Depends(key_required(config))]

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize(request: Request) -> dict:
        """llama-server's and vLLM's route: the text's token ids, as a completion's prompt would have them."""
        body = parse(TokenizeRequest, await read_json(request, config.body_timeout))
        check_model(body.model, config)
        try:
            return {"tokens": engine.tokenizer.encode(body.text, add_special_tokens=body.special)}
        except UnicodeError as e:  # lone surrogates
            raise BadRequest(f"cannot encode the text: {e}", code="invalid_value") from None

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize(request: Request) -> dict:
        body = parse(DetokenizeRequest, await read_json(request, config.body_timeout))
        check_model(body.model, config)
        check_token_ids(engine, body.tokens, "tokens")
        text = engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return {"content": text, "prompt": text}  # llama-server's key and vLLM's

    @app.get("/tokenizer_info", dependencies=keyed)
    async def tokenizer_info() -> dict:
        """vLLM's route: what a client needs to tokenize as the server does, through /tokenize
        (lm-eval's remote tokenizer reads it, so it needs no local copy of the tokenizer)."""
        tokenizer = engine.tokenizer
        return {"tokenizer_class": "specee", "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "pad_token": None, "chat_template": tokenizer.chat_template,
                "model_max_length": engine.context_length}


def check_model(model: str | None, config: ServerConfig) -> None:
    if model is not None and model != config.model_id:
        raise BadRequest(f"the model {model!r} does not exist; this server runs {config.model_id!r}",
                         param="model", code="model_not_found", status=404)


async def collect(request: Request, jobs: list[Job], inbox: Inbox) -> list[Result]:
    """The whole answers of a request's jobs; a client that hangs up cancels them."""
    async def watch_client():
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        for job in jobs:
            job.cancel()

    watcher = asyncio.create_task(watch_client())
    results: list[Result | None] = [None] * len(jobs)
    try:
        async for index, item in inbox.events():
            if isinstance(item, Ended):
                if item.outcome != "finished":
                    raise failure(item)
                results[index] = item.result
        return results
    finally:
        watcher.cancel()
        for job in jobs:
            job.cancel()  # no-op once finished; stops the work if this handler was cancelled


async def stream(jobs: list[Job], inbox: Inbox, shaper: Shaper, include_usage: bool) -> AsyncIterator[str]:
    """A request's jobs as server-sent events."""
    # A client that disconnects closes this generator (Starlette cancels it): the finally
    # cancels the jobs, and the worker stops them before their next step.
    results: list[Result | None] = [None] * len(jobs)
    gathered: list[str] = []  # events read while more were ready: one write for them all
    try:
        async for index, item in inbox.events():
            if isinstance(item, Event):
                gathered.append(sse(shaper.chunk(item, index)))
                if not inbox.ready():
                    yield "".join(gathered)
                    gathered.clear()
                continue
            if gathered:
                yield "".join(gathered)
                gathered.clear()
            if item.outcome != "finished":
                yield sse(failure(item).body())
                break
            results[index] = item.result
        else:
            if include_usage:
                yield sse(shaper.usage_chunk(results))
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            job.cancel()


async def told_on_failure(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's chunks; a bug that raises after the headers went out is logged, and the client
    gets an error event and [DONE] instead of a cut connection."""
    async with aclosing(chunks):  # a client that leaves closes the inner stream at once (it cancels the jobs)
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:
            log.error("a streamed answer failed", exc_info=e)
            yield sse(error_body(f"the answer failed: {type(e).__name__}", "server_error", None, "internal_error"))
            yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails at once."""
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listening.bind((host, port))
        listening.listen(2048)
    except OSError as e:
        listening.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listening


def start_line(host: str, port: int, engine: Engine) -> str:
    """What `specee serve` says when it starts serving: where, and the prefix cache's budget."""
    budget = engine.prefix_cache.budget_bytes
    cache = f"prefix cache up to {budget / 2**20:.0f} MiB" if budget else "prefix cache off"
    return f"specee serving on http://{host}:{port} ({cache}; {flag(LoadOptions, 'prefix_cache_mb')} sets it)"


def serve(engine: Engine, config: ServerConfig, listening: socket.socket) -> None:
    """Run until SIGTERM or Ctrl-C: then stop accepting, let running requests finish for
    `config.shutdown_grace` seconds (ending what still runs with an error event just before),
    stop the scheduler and return."""
    import signal

    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    app = create_app(engine, config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                margin = min(SHUTDOWN_MARGIN_S, config.shutdown_grace / 4)
                app.state.scheduler.drain(time.monotonic() + config.shutdown_grace - margin)
            super().handle_exit(sig, frame)

    class Protocol(H11Protocol):
        """uvicorn times out idle connections only once a response is complete: a new connection
        that sends nothing, or part of a request's headers, would be held forever. Here the whole
        headers must arrive within the keep-alive timeout (the body has config.body_timeout)."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.headers_timer = None
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._await_headers()

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _await_headers(self) -> None:
            if self.headers_timer is None and self._waiting_for_headers():
                self.headers_timer = self.loop.call_later(self.timeout_keep_alive, self._headers_overdue)

        def _headers_overdue(self) -> None:
            self.headers_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

    # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully; stopping a
    # server that way is normal, so the process then ends with exit code 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn_config = uvicorn.Config(app, http=Protocol, timeout_graceful_shutdown=config.shutdown_grace,
                                    timeout_keep_alive=config.keep_alive, log_level="info")
    host, port = listening.getsockname()[:2]
    log.info("%s", start_line(host, port, engine))
    Server(uvicorn_config).run(sockets=[listening])
