"""The router's HTTP face: an OpenAI-compatible proxy over the replicas (FastAPI + httpx).

| route                      | what                                                          |
|----------------------------|---------------------------------------------------------------|
| POST /v1/completions       | routed (:class:`~hybridkv.router.router.Router`), passed through |
| POST /v1/chat/completions  | the same                                                      |
| GET  /v1/models            | the first replica up's answer                                 |
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
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv import __version__
from hybridkv.errors import HybridKVError
from hybridkv.protocol.errors import error_body, to_response
from hybridkv.protocol.limits import BodyLimit, Offload, loads_json
from hybridkv.router.replica import Replica
from hybridkv.router.router import Router

__all__ = ["create_router_app"]

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
        yield
        await router.stop()
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

    async def proxy(request: Request, path: str, chat: bool) -> Response:
        raw = await request.body()
        try:  # parsed and tokenized on a worker thread: a large body never stalls the loop
            body = await offload.run(loads_json, raw)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        token_ids = await offload.run(router.prompt_ids, body, chat)
        stream = isinstance(body, dict) and body.get("stream") is True
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        tried: set[str] = set()
        sent_at = time.monotonic()
        while True:
            replica, predicted = await router.choose(token_ids, tried)  # none up: 503
            resident = await router._peek(replica, token_ids) if router.config.shadow_peek and token_ids else None
            replica.in_flight += 1
            try:
                upstream = await router.client.send(
                    router.client.build_request("POST", f"{replica.spec.url}{path}", content=raw, headers=headers),
                    stream=True,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                replica.in_flight -= 1  # mark_down counts the failure (once, when it goes down)
                metrics.requests.labels(replica.name, "connect_error").inc()
                router.mark_down(replica, f"connect: {exc.__class__.__name__}")
                tried.add(replica.name)
                continue
            except httpx.HTTPError as exc:
                replica.in_flight -= 1
                replica.num_failures += 1
                metrics.requests.labels(replica.name, "error").inc()
                return _error(502, f"replica {replica.name} failed: {exc.__class__.__name__}", "server_error")
            except BaseException:  # cancelled (the client left) before the replica answered
                replica.in_flight -= 1
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

        def done(outcome: str) -> None:
            replica.in_flight -= 1
            metrics.requests.labels(replica.name, outcome).inc()
            if outcome == "ok":  # a 2xx admitted its prompt: its blocks' KV events must follow
                router.served(replica, prompt_len, predicted, sent_at)

        if stream and upstream.status_code == 200:
            return StreamingResponse(_relay(upstream, replica, done, router), status_code=200, headers=out_headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            done("error")
            return _error(502, f"replica {replica.name} failed mid-response: {exc.__class__.__name__}", "server_error")
        finally:
            await upstream.aclose()
        # a 4xx admitted nothing (no KV events to wait for), a 5xx failed
        done("ok" if upstream.status_code < 400 else "rejected" if upstream.status_code < 500 else "error")
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        for r in router.candidates():
            try:
                resp = await router.client.get(f"{r.spec.url}/v1/models", timeout=router.config.probe_timeout)
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return _error(503, "no replica is up", "server_overloaded", {"Retry-After": str(router.config.retry_after)})

    @app.get("/health")
    async def health() -> Response:
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


async def _relay(upstream: httpx.Response, replica: Replica, done, router: Router):
    """Stream the replica's SSE bytes through; a replica that dies mid-stream ends it with an
    error event and ``[DONE]``; a client that leaves closes the upstream (the replica aborts)."""
    outcome = "ok"
    try:
        async for chunk in upstream.aiter_bytes():  # decoded: content-encoding is not passed on
            yield chunk
    except httpx.HTTPError as exc:
        outcome = "error"
        body = error_body(f"replica {replica.name} failed mid-stream: {exc.__class__.__name__}", "server_error")
        yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
        if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
            router.mark_down(replica, "failed mid-stream")
    finally:
        await upstream.aclose()
        done(outcome)


def _describe(r: Replica) -> dict:
    return {"name": r.name, "url": r.spec.url, "events": r.spec.events, "up": r.up, "stale": r.stale,
            "in_flight": r.in_flight, "requests": r.num_requests, "failures": r.num_failures,
            "indexed_blocks": r.num_blocks, "bad_events": r.num_bad_events, "index_resets": dict(r.num_resets)}
