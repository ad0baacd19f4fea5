"""``ASGIRunner``: ``serve``'s app driven in-process (how Ray Serve's replicas run it), on the tiny
model: the lifespan starts and stops the engine; a response arrives as a start then its body,
equal to the socket server's; a caller that leaves early aborts the request (as a dropped HTTP
client would), whether it closes the stream or its task is cancelled; the pool ends whole."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

pytest.importorskip("fastapi")

from hybridkv.integrations.asgi_call import ASGIRunner, ResponseStart  # noqa: E402
from hybridkv.server import AsyncLLM, ServerConfig, create_app  # noqa: E402
from hybridkv.server.metrics import ServerMetrics  # noqa: E402

JSON = [("content-type", "application/json")]


def _run(tiny_llm, body):
    async def main():
        metrics = ServerMetrics(tiny_llm.engine, "tiny")
        front = AsyncLLM(tiny_llm, metrics=metrics)
        app = create_app(front, ServerConfig(model_name="tiny"), metrics)
        runner = ASGIRunner(app)
        await runner.start()
        try:
            return await asyncio.wait_for(body(runner, front, metrics), 120), None
        finally:
            await runner.stop()
            assert app.state.final_blocks[0] == app.state.final_blocks[1]
            await runner.stop()  # idempotent

    return asyncio.run(main())[0]


async def _collect(runner, method, path, body=b""):
    parts = [p async for p in runner.request(method, path, JSON, body)]
    assert isinstance(parts[0], ResponseStart) and all(isinstance(p, bytes) for p in parts[1:])
    return parts[0], b"".join(parts[1:])


def test_responses_arrive_whole_and_streamed(tiny_llm):
    req = {"prompt": "hello world", "max_tokens": 6, "temperature": 0}

    async def body(runner, front, metrics):
        start, whole = await _collect(runner, "POST", "/v1/completions", json.dumps(req).encode())
        s_start, streamed = await _collect(runner, "POST", "/v1/completions", json.dumps({**req, "stream": True}).encode())
        bad_start, bad = await _collect(runner, "POST", "/v1/completions", b"{not json")
        models_start, models = await _collect(runner, "GET", "/v1/models")
        return start, json.loads(whole), s_start, streamed.decode(), bad_start, json.loads(bad), json.loads(models)

    start, whole, s_start, streamed, bad_start, bad, models = _run(tiny_llm, body)
    assert start.status == 200 and ("content-type", "application/json") in start.headers
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in streamed.split("\n\n") if e.startswith("data: {"))
    assert s_start.status == 200 and text == whole["choices"][0]["text"] and streamed.endswith("data: [DONE]\n\n")
    assert bad_start.status == 400 and bad["error"]["type"] == "invalid_request_error"
    assert models["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_caller_leaving_early_aborts_the_request(tiny_llm, how):
    rng = random.Random(len(how))
    leave_after = [rng.randint(1, 4) for _ in range(3)]
    req = json.dumps({"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()

    async def body(runner, front, metrics):
        for n in leave_after:
            streaming = asyncio.Event()

            async def consume(n=n):
                gen = runner.request("POST", "/v1/completions", JSON, req)
                seen = 0
                async for _ in gen:
                    seen += 1
                    if seen > n and how == "aclose":
                        await gen.aclose()
                        return
                    if seen > n:
                        streaming.set()  # cancelled while it awaits the next part, as Serve cancels a call

            task = asyncio.create_task(consume())
            if how == "cancel":
                await asyncio.wait_for(streaming.wait(), 30)
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for _ in range(500):
            if front.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        return front.num_unfinished, metrics.finished_counts()

    unfinished, counts = _run(tiny_llm, body)
    assert unfinished == 0 and counts["abort"] == len(leave_after) and counts["length"] == 0
