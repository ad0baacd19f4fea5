"""``route`` passes the fields real clients send through unchanged: through the router over the
real server app (in-process), every request answers what the replica answers directly (``n``
samples on one replica, echo + logprobs, prompt logprobs, penalties and bias, ``min_tokens``,
structured outputs, tools with ``tool_choice: "none"``), and bad values are the replica's 400s."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from hybridkv.router.replica import ReplicaSpec  # noqa: E402
from hybridkv.router.router import Router, RouterConfig  # noqa: E402

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALLS = [
    (C, {"prompt": "hello world", "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 7}),
    (C, {"prompt": [5, 6, 7, 8, 9], "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}),
    (C, {"prompt": "abc abc", "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1}),
    (C, {"prompt": "abc abc", "max_tokens": 6, "temperature": 0, "presence_penalty": 1.5,
         "repetition_penalty": 1.3, "logit_bias": {"66": 5}, "min_tokens": 4}),
    (C, {"prompt": "pick", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["abc", "xyz"]}}),
    (CHAT, {"messages": MSG, "n": 2, "max_tokens": 4, "temperature": 0.7, "seed": 3, "prompt_logprobs": 0}),
    (CHAT, {"messages": MSG, "max_tokens": 4, "temperature": 0, "tools": TOOLS, "tool_choice": "none"}),
    (CHAT, {"messages": MSG, "max_tokens": 4, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                              "function": {"name": "nope"}}}),
    (C, {"prompt": "x", "n": 0}),
    (C, {"prompt": "x", "logit_bias": {"99999": 1}}),
]


def _stable(body: dict) -> dict:
    """The answer without what differs per response (ids, times; the cached tokens: the second
    send of a prompt hits what the first cached)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    if "usage" in out:
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def test_new_fields_pass_through_the_router(tiny_llm):
    from hybridkv.router.app import create_router_app
    from hybridkv.server import AsyncLLM, ServerConfig, create_app

    async def main():
        front = AsyncLLM(tiny_llm)
        server = create_app(front, ServerConfig(model_name="tiny"))
        front.start()
        router = Router([ReplicaSpec("http://r0:8000")], RouterConfig(policy="least-loaded", health_interval=60),
                        tiny_llm.tokenizer, transport=httpx.ASGITransport(app=server))
        await router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://replica",
                                         timeout=60) as direct, \
                    httpx.AsyncClient(transport=httpx.ASGITransport(app=create_router_app(router)),
                                      base_url="http://router", timeout=60) as routed:
                pairs = [(await direct.post(path, json=body), await routed.post(path, json=body))
                         for path, body in CALLS]
        finally:
            await router.stop()
            blocks = await front.shutdown()
        return pairs, blocks

    pairs, (free, usable) = asyncio.run(main())
    assert free == usable
    for (direct, routed), (path, body) in zip(pairs, CALLS):
        assert routed.status_code == direct.status_code, (body, routed.text)
        assert _stable(routed.json()) == _stable(direct.json()), body
        assert routed.headers["x-hybridkv-replica"] == "r0"
    statuses = [d.status_code for d, _ in pairs]
    assert statuses == [200] * 7 + [400] * 3
    assert len(pairs[0][1].json()["choices"]) == 3 and len(pairs[5][1].json()["choices"]) == 2
    assert pairs[4][1].json()["choices"][0]["text"] in ("abc", "xyz")
