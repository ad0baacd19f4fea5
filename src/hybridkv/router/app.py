"""The router's HTTP face: an OpenAI-compatible proxy over the replicas (FastAPI + httpx).

| route                      | what                                                          |
|----------------------------|---------------------------------------------------------------|
| POST /v1/completions       | routed (:class:`~hybridkv.router.router.Router`), passed through |
| POST /v1/chat/completions  | the same                                                      |
| GET  /v1/models            | the first replica up's answer                                 |
| POST /tokenize, /detokenize | vLLM's tokenizer routes: a replica up's answer (no routing)  |
| GET  /tokenizer_info       | the same                                                      |
| GET  /health               | 200 while a replica is up, else 503                           |
| GET  /router/replicas      | per replica: up, in flight, indexed blocks, resets, bad events |
| GET  /metrics              | the router's Prometheus metrics                               |

A request body goes to the chosen replica byte for byte, and its answer comes back as
it arrives (server-sent events streamed through), with two headers added:
``x-hybridkv-replica`` (the replica's name) and ``x-hybridkv-predicted-hit`` (the hit
tokens the policy predicted there); with ``shadow_peek`` also ``x-hybridkv-resident-hit``
(what the replica's own manager held for it at the decision). A replica that refuses the connection is marked
down and the request goes to another one; no replica up is a 503 with ``Retry-After``; a
replica that fails after it accepted the request is a 502 (or, mid-stream, an SSE error
event and ``[DONE]``). Every error is OpenAI's JSON error body.

A client that goes away, streaming or not, closes its request's connection to the replica
(whose server then aborts the request): a non-streaming one is noticed within
:data:`~hybridkv.protocol.disconnect.POLL_SECONDS` (:func:`~hybridkv.protocol.disconnect.until_done_or_gone`),
a stream at its next chunk. At SIGTERM or SIGINT ``hybridkv route`` first drains
(:func:`drain`: new requests and ``/health`` get 503 while those in flight go on), then,
at its ``--shutdown-timeout``, stops the router (:func:`stop_soon`, also at the end of the
app's lifespan): :meth:`Router.stop` closes its connections to the replicas at once: the
replicas abort what was in flight, and each waiting client gets a 503 (a stream: an SSE
error event and ``[DONE]``) instead of waiting for it.
Every request counts once in ``hybridkv_router_requests{outcome}``: ``ok``, ``rejected``
(a 4xx), ``error``, ``connect_error`` (retried elsewhere), ``client_gone`` or
``router_stopped``; ``in_flight`` counts it until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Callable

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv import __version__
from hybridkv.errors import HybridKVError
from hybridkv.protocol.disconnect import until_done_or_gone
from hybridkv.protocol.errors import error_body, to_response
from hybridkv.protocol.limits import BodyLimit, Offload, loads_json
from hybridkv.router.replica import Replica
from hybridkv.router.router import Router

__all__ = ["create_router_app", "drain", "stop_soon"]

log = logging.getLogger("hybridkv.router")

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                "proxy-authorization", "te", "trailer", "accept-encoding"}


def _error(status: int, message: str, type_: str, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error shape, as the server writes it (``code`` null: the status and type say it)."""
    return JSONResponse(error_body(message, type_), status_code=status, headers=headers)


class _Metrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hybridkv_router_requests", "Requests routed, by replica and outcome",
                                ["replica", "outcome"], registry=r)
        self.predicted = Counter("hybridkv_router_predicted_hit_tokens", "Hit tokens the policy predicted",
                                 ["replica"], registry=r)
        self.up = Gauge("hybridkv_router_replica_up", "1 while the replica takes requests", ["replica"], registry=r)
        self.in_flight = Gauge("hybridkv_router_replica_in_flight", "Requests in flight", ["replica"], registry=r)
        self.blocks = Gauge("hybridkv_router_indexed_blocks", "Blocks in the replica's index", ["replica"], registry=r)
        self.bad = Gauge("hybridkv_router_bad_events", "Events the index could not use", ["replica"], registry=r)
        self.resets = Gauge("hybridkv_router_index_resets", "Index drops by reason", ["replica", "reason"], registry=r)
        self.decision = Gauge("hybridkv_router_decision_seconds_mean", "Mean seconds per routing decision",
                              registry=r)
        self.router = router

    def render(self) -> bytes:
        for rep in self.router.replicas:
            self.up.labels(rep.name).set(1 if rep.up else 0)
            self.in_flight.labels(rep.name).set(rep.in_flight)
            self.blocks.labels(rep.name).set(rep.num_blocks)
            self.bad.labels(rep.name).set(rep.num_bad_events)
            for reason, n in rep.num_resets.items():
                self.resets.labels(rep.name, reason).set(n)
        n = self.router.num_decisions
        self.decision.set(self.router.decision_seconds / n if n else 0.0)
        return generate_latest(self.registry)


def create_router_app(router: Router) -> FastAPI:
    metrics = _Metrics(router)
    offload = Offload()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Future] = []

        def stop() -> None:  # once: at the server's first signal (stop_soon), else at the lifespan's end
            if not stopping:
                stopping.append(asyncio.ensure_future(router.stop()))

        app.state.stop_soon = lambda: loop.call_soon_threadsafe(stop)
        app.state.drain = router.drain  # a flag: safe from a signal handler
        try:
            yield
        finally:
            app.state.stop_soon = app.state.drain = None
            stop()
            await stopping[0]
            offload.close()

    app = FastAPI(title="hybridkv router", version=__version__, lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=router.config.max_request_bytes)  # 413 before parsing

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(HybridKVError)
    async def _hybridkv(request: Request, exc: HybridKVError):
        r = to_response(exc)
        return JSONResponse(r.body, status_code=r.status, headers=r.headers)

    def shutting_down() -> JSONResponse:
        return _error(503, "the router is shutting down", "server_overloaded",
                      {"Retry-After": str(router.config.retry_after)})

    async def proxy(request: Request, path: str, chat: bool) -> Response:
        if router.refusing:
            return shutting_down()
        raw = await request.body()  # all of it before until_done_or_gone reads the ASGI messages
        answer = await until_done_or_gone(request, forward(raw, _forwarded(request), path, chat))
        if answer is None:  # the client left (its replica's request was closed); nobody reads this
            return Response(status_code=499)
        return answer

    async def forward(raw: bytes, headers: dict, path: str, chat: bool) -> Response:
        """Choose a replica, send it the request, and answer with what it answers (see the module
        docstring). Cancelled (the client left): the upstream is closed, the outcome counted."""
        try:  # parsed and tokenized on a worker thread: a large body never stalls the loop
            body = await offload.run(loads_json, raw)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        token_ids = await offload.run(router.prompt_ids, body, chat)
        stream = isinstance(body, dict) and body.get("stream") is True
        tried: set[str] = set()
        sent_at = time.monotonic()
        while True:
            replica, predicted = await router.choose(token_ids, tried)  # none up: 503
            resident = await router._peek(replica, token_ids) if router.config.shadow_peek and token_ids else None
            client = router.client
            if router.stopping or client is None:
                return shutting_down()
            replica.in_flight += 1
            try:
                upstream = await client.send(
                    client.build_request("POST", f"{replica.spec.url}{path}", content=raw, headers=headers),
                    stream=True,
                )
            except Exception as exc:
                replica.in_flight -= 1
                if router.stopping:  # its client was closed under it
                    metrics.requests.labels(replica.name, "router_stopped").inc()
                    return shutting_down()
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    metrics.requests.labels(replica.name, "connect_error").inc()
                    router.mark_down(replica, f"connect: {exc.__class__.__name__}")  # counts the failure, once
                    tried.add(replica.name)
                    continue
                if not isinstance(exc, httpx.HTTPError):
                    raise
                replica.num_failures += 1
                metrics.requests.labels(replica.name, "error").inc()
                return _error(502, f"replica {replica.name} failed: {exc.__class__.__name__}", "server_error")
            except BaseException:  # cancelled (the client left) before the replica answered: the
                replica.in_flight -= 1  # connection is closed by httpx, the replica aborts
                metrics.requests.labels(replica.name, "client_gone").inc()
                raise
            break
        replica.num_requests += 1
        metrics.predicted.labels(replica.name).inc(predicted)
        out_headers = {"x-hybridkv-replica": replica.name, "x-hybridkv-predicted-hit": str(predicted)}
        if resident is not None:
            out_headers["x-hybridkv-resident-hit"] = str(resident)
        for key in ("content-type", "retry-after"):
            if key in upstream.headers:
                out_headers[key] = upstream.headers[key]
        prompt_len = len(token_ids) if token_ids else None

        def finish(outcome: str) -> None:
            replica.in_flight -= 1
            metrics.requests.labels(replica.name, outcome).inc()
            if outcome == "ok":  # a 2xx admitted its prompt: its blocks' KV events must follow
                router.served(replica, prompt_len, predicted, sent_at)

        exchange = _Exchange(upstream, finish)
        if stream and upstream.status_code == 200:
            return _Relay(exchange, replica, router, out_headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            if router.stopping:
                await exchange.close("router_stopped")
                return shutting_down()
            await exchange.close("error")
            return _error(502, f"replica {replica.name} failed mid-response: {exc.__class__.__name__}", "server_error")
        except BaseException:  # cancelled: the client left
            await exchange.close("client_gone")
            raise
        status = upstream.status_code  # a 4xx admitted nothing (no KV events to wait for), a 5xx failed
        await exchange.close("ok" if status < 400 else "rejected" if status < 500 else "error")
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions", chat=True)

    async def any_replica(request: Request, method: str, path: str) -> Response:
        """The answer of the first replica up to the client's request, body byte for byte and
        headers (its Authorization) passed on, with ``x-hybridkv-replica``: the tokenizer routes,
        which any replica answers alike (they serve one model). A replica that refuses the
        connection is marked down and the next one asked, as is one that fails mid-way (the
        routes change nothing); none up: 503 with ``Retry-After``; all failing: 502."""
        if router.refusing:
            return shutting_down()
        raw = await request.body() if method == "POST" else None
        failed: list[str] = []
        for r in router.candidates():
            client = router.client
            if router.stopping or client is None:
                return shutting_down()
            try:
                resp = await client.request(method, f"{r.spec.url}{path}", content=raw, headers=_forwarded(request))
            except Exception as exc:
                if router.stopping:  # its client was closed under it
                    return shutting_down()
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    router.mark_down(r, f"connect: {exc.__class__.__name__}")
                    continue
                if not isinstance(exc, httpx.HTTPError):
                    raise
                failed.append(f"{r.name}: {exc.__class__.__name__}")
                continue
            headers = {"x-hybridkv-replica": r.name}
            for key in ("content-type", "retry-after"):
                if key in resp.headers:
                    headers[key] = resp.headers[key]
            return Response(resp.content, status_code=resp.status_code, headers=headers)
        if failed:
            return _error(502, f"replicas failed: {', '.join(failed)}", "server_error")
        return _error(503, "no replica is up", "server_overloaded", {"Retry-After": str(router.config.retry_after)})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await any_replica(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await any_replica(request, "POST", "/detokenize")

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await any_replica(request, "GET", "/tokenizer_info")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for r in router.candidates():
            if router.stopping or router.client is None:
                return shutting_down()
            try:  # the client's headers (its Authorization) go along, as on the generation routes
                resp = await router.client.get(f"{r.spec.url}/v1/models", headers=_forwarded(request),
                                               timeout=router.config.probe_timeout)
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return _error(503, "no replica is up", "server_overloaded", {"Retry-After": str(router.config.retry_after)})

    @app.get("/health")
    async def health() -> Response:
        if router.refusing:
            return JSONResponse({"status": "shutting_down", "replicas_up": 0}, status_code=503)
        up = len(router.candidates())
        return JSONResponse({"status": "ok" if up else "no_replica", "replicas_up": up}, status_code=200 if up else 503)

    @app.get("/router/replicas")
    async def replicas() -> dict:
        shares = getattr(router.policy, "shares", None)  # the balance rule's, on hit-ranking policies
        return {"policy": router.policy.name.value,
                "replicas": [{**_describe(r), "recent_share": None if shares is None else round(shares.share(r.name), 4)}
                             for r in router.replicas]}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _forwarded(request: Request) -> dict:
    """The client's headers that go on to a replica: all but the hop-by-hop ones."""
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}


class _Exchange:
    """A replica's answer in flight: its upstream response is closed (which closes the
    connection unless the answer was read to its end) and ``finish(outcome)`` called, once."""

    __slots__ = ("upstream", "finish", "closed")

    def __init__(self, upstream: httpx.Response, finish: Callable[[str], None]) -> None:
        self.upstream, self.finish, self.closed = upstream, finish, False

    async def close(self, outcome: str) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            with anyio.CancelScope(shield=True):  # also from a cancelled task or scope
                await self.upstream.aclose()
        finally:
            self.finish(outcome)


class _Relay(StreamingResponse):
    """The replica's SSE bytes, passed through as they arrive. A replica that dies mid-stream
    ends it with an error event and ``[DONE]`` (and is marked down); so does the router's
    stop. However the response ends -- the client gone (the next chunk's send fails or the
    server reports the disconnect), even before the first byte -- its upstream is closed
    (the replica aborts) and its outcome counted."""

    def __init__(self, exchange: _Exchange, replica: Replica, router: Router, headers: dict) -> None:
        self.exchange, self.replica, self.router = exchange, replica, router
        self.outcome = "client_gone"  # unless the stream reaches its end
        super().__init__(self._chunks(), status_code=200, headers=headers)

    async def _chunks(self):
        try:
            async for chunk in self.exchange.upstream.aiter_bytes():  # decoded: content-encoding is not passed on
                yield chunk
        except httpx.HTTPError as exc:
            if self.router.stopping:
                self.outcome, message = "router_stopped", "the router is shutting down"
            else:
                self.outcome = "error"
                message = f"replica {self.replica.name} failed mid-stream: {exc.__class__.__name__}"
                if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
                    self.router.mark_down(self.replica, "failed mid-stream")
            body = error_body(message, "server_error")
            yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
            return
        self.outcome = "ok"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.exchange.close(self.outcome)


def drain(app: FastAPI) -> None:
    """Refuse new requests on the router of ``app`` while those in flight go on (the first
    signal of a shutdown with a deadline; :func:`stop_soon` at the deadline)."""
    drain_ = getattr(app.state, "drain", None)
    if drain_ is not None:
        drain_()


def stop_soon(app: FastAPI) -> None:
    """Stop the router of ``app`` (from a signal handler or another thread) without waiting for
    the HTTP server to drain: its connections to the replicas close at once, so the replicas
    abort what was in flight and each waiting client gets a 503. Nothing before the app's
    lifespan started or after it ended."""
    stop = getattr(app.state, "stop_soon", None)
    if stop is not None:
        stop()


def _describe(r: Replica) -> dict:
    return {"name": r.name, "url": r.spec.url, "events": r.spec.events, "up": r.up, "stale": r.stale,
            "in_flight": r.in_flight, "requests": r.num_requests, "failures": r.num_failures,
            "indexed_blocks": r.num_blocks, "bad_events": r.num_bad_events, "index_resets": dict(r.num_resets)}
