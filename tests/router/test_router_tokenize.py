"""vLLM's tokenizer routes through ``route``: passed to a replica that is up, the body byte for
byte and the client's headers (Authorization) along, the answer as the replica gave it; over
fake replicas (httpx.MockTransport) and over the real server app in-process."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from hybridkv.router.replica import ReplicaSpec  # noqa: E402
from hybridkv.router.router import Router, RouterConfig  # noqa: E402
from tests.support.fake_replicas import run_router  # noqa: E402

#: a replica's answers, oddly spaced: the router must pass them on as they are
TOKENS = b'{"count": 2,  "max_model_len": 9, "tokens": [5 ,6], "token_strs": null}'
INFO = b'{"tokenizer_class": "HFTokenizer", "eos_token": "</s>"}'
REFUSED = b'{"error": {"message": "tokens", "type": "invalid_request_error", "param": "tokens", "code": null}}'


class TokenizerReplicas:
    """Replicas at http://rN:8000: ``dead`` refuse connections, ``failing`` reset them mid-way."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.dead: set[str] = set()
        self.failing: set[str] = set()
        self.seen: list[tuple[str, str, str, bytes, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if host in self.failing:
            raise httpx.ReadError("connection reset", request=request)
        self.seen.append((host, request.method, path, request.content, request.headers.get("authorization")))
        json_type = {"content-type": "application/json"}
        if path == "/tokenizer_info":
            return httpx.Response(200, content=INFO, headers=json_type)
        if b"128" in request.content:
            return httpx.Response(400, content=REFUSED, headers=json_type)
        return httpx.Response(200, content=TOKENS if path == "/tokenize" else b'{"prompt": "hi"}', headers=json_type)


def test_tokenizer_routes_pass_through_byte_for_byte_with_the_clients_headers():
    fake = TokenizerReplicas(2)
    tokenize = b'{"prompt":  "a b",\n "add_special_tokens": false, "unknown": [1]}'
    auth = {"authorization": "Bearer k", "content-type": "application/json"}

    async def body(client, router):
        return (await client.post("/tokenize", content=tokenize, headers=auth),
                await client.post("/detokenize", content=b'{"tokens": [1, 2]}', headers=auth),
                await client.post("/detokenize", content=b'{"tokens": [128]}', headers=auth),
                await client.get("/tokenizer_info", headers=auth),
                [r.in_flight for r in router.replicas])

    tok, detok, refused, info, in_flight = run_router(fake, body, "round-robin")
    assert tok.status_code == 200 and tok.content == TOKENS
    assert tok.headers["content-type"] == "application/json" and tok.headers["x-hybridkv-replica"] == "r0"
    assert detok.json() == {"prompt": "hi"}
    assert refused.status_code == 400 and refused.content == REFUSED  # the replica's own refusal
    assert info.status_code == 200 and info.content == INFO
    assert fake.seen == [
        ("r0", "POST", "/tokenize", tokenize, "Bearer k"),
        ("r0", "POST", "/detokenize", b'{"tokens": [1, 2]}', "Bearer k"),
        ("r0", "POST", "/detokenize", b'{"tokens": [128]}', "Bearer k"),
        ("r0", "GET", "/tokenizer_info", b"", "Bearer k"),
    ]
    assert in_flight == [0, 0]  # no routing: nothing counted in flight


def test_a_replica_down_or_failing_is_skipped_and_none_left_is_503_or_502():
    fake = TokenizerReplicas(3)

    async def body(client, router):
        fake.dead.add("r0")
        first = await client.post("/tokenize", json={"prompt": "x"})
        up = [r.up for r in router.replicas]
        fake.failing.add("r1")
        second = await client.get("/tokenizer_info")
        fake.failing.add("r2")
        failing = await client.post("/detokenize", json={"tokens": [1]})
        fake.dead.update({"r1", "r2"})
        none = await client.post("/tokenize", json={"prompt": "x"})
        return first, up, second, failing, none, [r.up for r in router.replicas]

    first, up, second, failing, none, up_after = run_router(fake, body)
    assert first.status_code == 200 and first.headers["x-hybridkv-replica"] == "r1"
    assert up == [False, True, True]  # a refused connection marks the replica down
    assert second.status_code == 200 and second.headers["x-hybridkv-replica"] == "r2"
    assert failing.status_code == 502 and failing.json()["error"]["type"] == "server_error"
    assert "r1" in failing.json()["error"]["message"] and "r2" in failing.json()["error"]["message"]
    assert none.status_code == 503 and none.headers["retry-after"] == "1"
    assert none.json()["error"]["type"] == "server_overloaded"
    assert up_after == [False, False, False]


def test_through_the_router_the_answers_are_the_replicas(tiny_llm):
    """The router over the real server app (in-process, ``--api-key k``): each route answers
    through the router what the replica answers directly, the key passed on (401 without it)."""
    from hybridkv.router.app import create_router_app
    from hybridkv.server import AsyncLLM, ServerConfig, create_app

    key = {"authorization": "Bearer k"}
    calls = [("POST", "/tokenize", {"prompt": "hello world", "return_token_strs": True}),
             ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
             ("POST", "/detokenize", {"tokens": [1, 14, 11, 2]}),
             ("POST", "/detokenize", {"tokens": [128]}),
             ("GET", "/tokenizer_info", None)]

    async def main():
        front = AsyncLLM(tiny_llm)
        server = create_app(front, ServerConfig(model_name="tiny", api_key="k"))
        front.start()
        router = Router([ReplicaSpec("http://r0:8000")], RouterConfig(policy="least-loaded", health_interval=60),
                        transport=httpx.ASGITransport(app=server))
        await router.start()
        try:
            direct_t = httpx.ASGITransport(app=server)
            routed_t = httpx.ASGITransport(app=create_router_app(router))
            async with httpx.AsyncClient(transport=direct_t, base_url="http://replica") as direct, \
                    httpx.AsyncClient(transport=routed_t, base_url="http://router") as routed:
                pairs = [(await direct.request(m, p, json=b, headers=key),
                          await routed.request(m, p, json=b, headers=key)) for m, p, b in calls]
                no_key = await routed.post("/tokenize", json={"prompt": "x"})
        finally:
            await router.stop()
            await front.shutdown()
        return pairs, no_key

    pairs, no_key = asyncio.run(main())
    for (direct, routed), (_, path, _) in zip(pairs, calls):
        assert routed.status_code == direct.status_code and routed.json() == direct.json(), path
        assert routed.headers["x-hybridkv-replica"] == "r0"
    assert [d.status_code for d, _ in pairs] == [200, 200, 200, 400, 200]
    assert pairs[0][1].json()["tokens"] == tiny_llm.tokenizer.encode("hello world")
    assert pairs[4][1].json()["eos_token"] == "</s>"
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
