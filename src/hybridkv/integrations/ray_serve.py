"""hybridkv on Ray Serve: replicas of ``serve``'s app, routed by hybridkv's KV-aware policy.

    pip install 'hybridkv[ray]'
    hybridkv ray-serve smollm2-135m --replicas 2 --port 8000         # a local Ray cluster
    serve run hybridkv.integrations.ray_serve:app_builder model=smollm2-135m num_replicas=2

Two deployments:

* :class:`HybridkvReplica` (``num_replicas`` of them): each runs
  :func:`hybridkv.server.build_app`'s app, the one ``hybridkv serve`` runs, in-process
  (:class:`~hybridkv.integrations.asgi_call.ASGIRunner`), with KV events published on its
  node's address; it advertises their endpoints in ``record_replica_metadata`` and reports
  ``{"unfinished", "finished"}`` (requests, by finish reason) as its routing stats.
* :class:`HybridkvIngress` (one, behind Ray's HTTP proxy): OpenAI's routes. A generation
  request is first rendered by a replica (``/v1/.../render``: the prompt's token ids, and
  every 4xx a generation would get), then sent with ``token_ids=`` on the replica handle,
  whose :class:`~hybridkv.integrations.ray_router.KVAwareRequestRouter` picks the replica
  whose KV cache holds the longest valid prefix (hybridkv's ``hybrid`` policy). The reply
  streams back chunk by chunk, with the header ``x-hybridkv-replica`` naming the replica; a
  client that disconnects cancels the call, which the replica's app sees as its client
  leaving (the engine request is aborted). A completions request with several prompts is
  routed by its first. Any other route (GET, POST, a CORS preflight) is forwarded to the
  replica with the fewest calls in flight; ``GET /hybridkv/replicas`` shows the router's view
  (index blocks, in flight, stats).

Configuration crosses Ray as plain dicts: ``engine`` holds
:class:`~hybridkv.engine_config.EngineConfig` fields, ``server``
:class:`~hybridkv.server.ServerConfig` fields (``kv_events`` are set here).
"""

# no `from __future__ import annotations`: Serve rewrites the routes' signatures and FastAPI must
# see real classes (Request) in them
import asyncio
import json
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from hybridkv.integrations.asgi_call import ASGIRunner, ResponseStart
from hybridkv.integrations import ray_index  # the module: Serve may ship this class by value, with copied globals
from hybridkv.router.balance import DEFAULT_MAX_SHARE_RATIO, DEFAULT_SHARE_WINDOW
from hybridkv.router.policy import DEFAULT_MAX_IMBALANCE

__all__ = ["HybridkvIngress", "HybridkvReplica", "app_builder", "build_ray_app"]

ROUTER_CLASS = "hybridkv.integrations.ray_router.KVAwareRequestRouter"
#: request headers passed on to a replica (the rest are the proxy's business)
FORWARDED = ("authorization", "content-type", "accept", "origin", "access-control-request-method",
             "access-control-request-headers")
_HOP_BY_HOP = ("content-length", "transfer-encoding", "connection")
_GENERATE = ("/v1/completions", "/v1/chat/completions")


@serve.deployment(name="HybridkvReplica")
class HybridkvReplica:
    """One engine: ``serve``'s app, called in-process (see the module docstring)."""

    def __init__(self, model: str, engine: dict | None = None, server: dict | None = None) -> None:
        from hybridkv.engine_config import EngineConfig
        from hybridkv.server import ServerConfig, build_app

        host = ray.util.get_node_ip_address()
        server = {"model_name": model, **(server or {}),
                  "kv_events": f"tcp://{host}:0", "kv_events_replay": f"tcp://{host}:0"}
        self.app = build_app(model, engine=EngineConfig(**(engine or {})), server=ServerConfig(**server))
        self.front = self.app.state.front
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._runner = ASGIRunner(self.app)
        self._started: asyncio.Task | None = None

    async def _ready(self) -> None:
        if self._started is None:  # the engine thread starts on the replica's event loop, once
            self._started = asyncio.ensure_future(self._runner.start())
        await asyncio.shield(self._started)

    def record_replica_metadata(self) -> dict:
        pub = self.front.kv_publisher
        return {"kv_events": pub.endpoint, "kv_events_replay": pub.replay_endpoint,
                "block_size": self.front.engine.config.block_size}

    def record_routing_stats(self) -> dict:
        return {"unfinished": self.front.num_unfinished, "finished": self.app.state.metrics.finished_counts()}

    async def stream(self, method: str, path: str, headers: list, body: bytes = b"",
                     token_ids: list[int] | None = None) -> AsyncIterator[dict | bytes]:
        """The app's response: first ``{"status", "headers"}``, then body chunks (``token_ids``
        is for the router, which reads it off the call)."""
        await self._ready()
        parts = self._runner.request(method, path, headers, body)
        try:
            async for part in parts:
                if isinstance(part, ResponseStart):
                    kept = [(k, v) for k, v in part.headers if k.lower() not in _HOP_BY_HOP]
                    yield {"status": part.status, "headers": kept + [("x-hybridkv-replica", self.replica_id)]}
                else:
                    yield part
        finally:  # left early (cancelled, closed): the app's request sees its client disconnect now
            await parts.aclose()

    async def call(self, method: str, path: str, headers: list, body: bytes = b"") -> dict:
        """The app's whole response: ``{"status", "headers", "body"}``."""
        start, chunks = None, []
        async for part in self.stream(method, path, headers, body):
            if isinstance(part, dict):
                start = part
            else:
                chunks.append(part)
        return {**start, "body": b"".join(chunks)}

    async def __del__(self) -> None:  # Serve's graceful shutdown: requests aborted, the pool checked
        await self._runner.stop()


_api = FastAPI(title="hybridkv on Ray Serve")


@serve.deployment(name="HybridkvIngress")
@serve.ingress(_api)  # at import, in every process: Serve rewrites _api's routes to methods here
class HybridkvIngress:
    """OpenAI's routes in front of the replicas (see the module docstring)."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas
        self.streaming = replicas.options(stream=True)

    @staticmethod
    def _headers(request: Request) -> list:
        return [(k, v) for k, v in request.headers.items() if k.lower() in FORWARDED]

    @staticmethod
    def _whole(answer: dict) -> Response:
        return Response(answer["body"], status_code=answer["status"], headers=dict(answer["headers"]))

    @_api.get("/hybridkv/replicas")
    async def replicas_view(self) -> JSONResponse:
        return JSONResponse({"replicas": ray_index.REPLICAS.snapshot()})

    @_api.post("/v1/completions")
    @_api.post("/v1/chat/completions")
    async def generate(self, request: Request) -> Response:
        path, headers, body = request.url.path, self._headers(request), await request.body()
        rendered = await self.replicas.call.remote("POST", path + "/render", headers, body)
        if rendered["status"] != 200:  # the 4xx generation would answer: nothing to route
            return self._whole(rendered)
        items = json.loads(rendered["body"])
        first = items[0] if isinstance(items, list) else items
        gen = self.streaming.stream.remote("POST", path, headers, body, token_ids=first["token_ids"])
        start = await gen.__anext__()
        return StreamingResponse(self._rest(gen), status_code=start["status"], headers=dict(start["headers"]))

    @staticmethod
    async def _rest(gen) -> AsyncIterator[bytes]:
        done = False
        try:
            async for chunk in gen:
                yield chunk
            done = True
        finally:
            if not done:
                gen.cancel()  # a client gone mid-stream: the replica's app sees it disconnect

    @_api.api_route("/{path:path}", methods=["GET", "POST", "OPTIONS"])  # OPTIONS: CORS preflights
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        return self._whole(await self.replicas.call.remote(request.method, "/" + path, self._headers(request), body))


def build_ray_app(model: str, *, num_replicas: int = 2, engine: dict | None = None, server: dict | None = None,
                  policy: str = "hybrid", max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                  max_share_ratio: float | None = DEFAULT_MAX_SHARE_RATIO, share_window: int = DEFAULT_SHARE_WINDOW,
                  max_ongoing_requests: int = 64, replica_cpus: float = 0.0):
    """The bound Serve application: ``num_replicas`` :class:`HybridkvReplica` behind a
    :class:`HybridkvIngress`, for ``serve.run``. ``replica_cpus``: Ray CPUs each replica
    reserves (0: any number share a machine; torch uses its own threads). ``policy``,
    ``max_imbalance``, ``max_share_ratio`` (None: no share rule), ``share_window``: as ``route``'s."""
    router = RequestRouterConfig(request_router_class=ROUTER_CLASS, request_routing_stats_period_s=1.0,
                                 request_routing_stats_timeout_s=5.0,
                                 request_router_kwargs={"policy": policy, "max_imbalance": max_imbalance,
                                                        "max_share_ratio": max_share_ratio, "share_window": share_window})
    replica = HybridkvReplica.options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests, request_router_config=router,
        ray_actor_options={"num_cpus": replica_cpus},
    ).bind(model, engine or {}, server or {})
    ingress = HybridkvIngress.options(
        max_ongoing_requests=4 * max_ongoing_requests * num_replicas, ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replica)


def app_builder(args: dict) -> Any:
    """``serve run hybridkv.integrations.ray_serve:app_builder model=NAME [num_replicas=N]
    [engine='{"max_model_len": 2048}'] [server='{...}'] [policy=hybrid]`` (Serve passes the
    ``key=value`` pairs as strings)."""
    def parsed(key: str) -> dict | None:
        value = args.get(key)
        return json.loads(value) if isinstance(value, str) else value

    return build_ray_app(str(args["model"]), num_replicas=int(args.get("num_replicas", 2)), engine=parsed("engine"),
                         server=parsed("server"), policy=str(args.get("policy", "hybrid")))
