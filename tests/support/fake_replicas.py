"""Fake replicas for the router's in-process tests (httpx.MockTransport) and the harness
that runs the router app over them."""

from __future__ import annotations

import asyncio
import json

import httpx

from hybridkv.router.replica import ReplicaSpec
from hybridkv.router.router import Router, RouterConfig

__all__ = ["SSE", "FakeReplicas", "run_router"]

SSE = b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n'


class FakeReplicas:
    """Replicas at http://rN:8000: ``dead`` refuse connections, ``broken`` die mid-stream."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.dead: set[str] = set()
        self.broken: set[str] = set()
        self.seen: list[tuple[str, str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        body = json.loads(request.content)
        self.seen.append((host, path, body))
        if body.get("max_tokens") == 0:
            return httpx.Response(400, json={"error": {"message": "max_tokens", "type": "invalid_request_error",
                                                       "param": "max_tokens", "code": None}})
        if body.get("stream"):
            if host in self.broken:
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Broken())
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=SSE)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": host}], "usage": {}})


class _Broken(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        raise httpx.ReadError("connection reset")


def run_router(fake, body, policy: str = "least-loaded", *, config: RouterConfig | None = None, n: int | None = None,
         tokenizer=None):
    """``await body(client, router)`` through the router app over ``n`` (``fake.n``) fake
    replicas served by ``fake`` (an httpx.MockTransport handler)."""
    from hybridkv.router.app import create_router_app

    router = Router([ReplicaSpec(f"http://r{i}:8000") for i in range(fake.n if n is None else n)],
                    config or RouterConfig(policy=policy, health_interval=60), tokenizer,
                    transport=httpx.MockTransport(fake))
    app = create_router_app(router)

    async def main():
        await router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=30) as client:
                return await body(client, router)
        finally:
            await router.stop()

    return asyncio.run(main())
