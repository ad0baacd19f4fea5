"""Large and slow requests, in-process: a body over ``max_request_bytes`` is
a 413 in OpenAI's error shape before anything parses it (declared or chunked); a prompt that
cannot fit the context is refused before it is tokenized; parsing and tokenization run off the
event loop, so ``/health`` answers while a slow request is being prepared."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from hybridkv.errors import InvalidConfigError
from hybridkv.server import ServerConfig
from hybridkv.protocol.limits import DEFAULT_MAX_REQUEST_BYTES, too_large_body

from tests.support.tiny_server import run_app

C, CHAT = "/v1/completions", "/v1/chat/completions"


def _body(prompt_chars: int) -> bytes:
    return json.dumps({"prompt": "a" * prompt_chars, "max_tokens": 2, "temperature": 0}).encode()


def _chunks(data: bytes, size: int = 1000):
    async def gen():
        for i in range(0, len(data), size):
            yield data[i : i + size]
    return gen()


def test_bodies_over_the_limit_are_413_declared_or_chunked(tiny_llm):
    limit = 2000
    ok = _body(100)
    assert len(ok) < limit

    async def body(client, front, app):
        submitted = []
        submit = front.submit

        async def counting(prompts, *a, **k):
            submitted.append(len(prompts))
            return await submit(prompts, *a, **k)

        front.submit = counting
        declared = await client.post(C, content=_body(3000), headers={"content-type": "application/json"})
        chunked = await client.post(C, content=_chunks(_body(3000)), headers={"content-type": "application/json"})
        exact = json.dumps({"prompt": "b", "max_tokens": 1, "user": "x" * 100}).encode()
        exact = exact.replace(b'"x', b'"' + b"y" * (limit - len(exact)) + b"x", 1)  # exactly the limit
        at_limit = await client.post(C, content=exact, headers={"content-type": "application/json"})
        small = await client.post(C, content=ok, headers={"content-type": "application/json"})
        small_chunked = await client.post(C, content=_chunks(ok, 7), headers={"content-type": "application/json"})
        health = await client.get("/health")
        return declared, chunked, len(exact), at_limit, small, small_chunked, health, len(submitted)

    (declared, chunked, exact_len, at_limit, small, small_chunked, health, seen), (free, usable) = run_app(
        tiny_llm, body, config=ServerConfig(model_name="tiny", max_request_bytes=limit))
    for r in (declared, chunked):
        assert r.status_code == 413
        assert r.json() == json.loads(too_large_body(limit))
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "request_too_large" and "2,000 bytes" in r.json()["error"]["message"]
    assert exact_len == limit and at_limit.status_code == 200
    assert small.status_code == 200 and small_chunked.status_code == 200
    assert small.json()["choices"][0]["text"] == small_chunked.json()["choices"][0]["text"]
    assert health.status_code == 200
    assert seen == 3  # the refused ones never reached the engine
    assert free == usable


def test_max_request_bytes_is_checked():
    assert ServerConfig().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(InvalidConfigError, match="max_request_bytes"):
            ServerConfig(max_request_bytes=bad)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tiny_llm, monkeypatch):
    tok = tiny_llm.tokenizer
    calls: list[int] = []
    encode = tok.encode

    def spy(text, *a, **k):
        calls.append(len(text))
        return encode(text, *a, **k)

    monkeypatch.setattr(tok, "encode", spy)
    big = 2_000_000

    async def body(client, front, app):
        t0 = time.perf_counter()
        text = await client.post(C, json={"prompt": "a" * big, "max_tokens": 2})
        chat = await client.post(CHAT, json={"messages": [{"role": "user", "content": "a" * big}], "max_tokens": 2})
        return text, chat, time.perf_counter() - t0

    (text, chat, seconds), (free, usable) = run_app(
        tiny_llm, body, config=ServerConfig(model_name="tiny", max_request_bytes=16 * 2**20))
    assert text.status_code == 400 and text.json()["error"]["code"] == "context_length_exceeded"
    assert text.json()["error"]["param"] == "prompt" and "2,000,000 characters" in text.json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert all(n < big for n in calls)  # neither huge text was tokenized
    assert seconds < 10 and free == usable


def test_slow_preparation_runs_off_the_event_loop(tiny_llm, monkeypatch):
    """A request whose tokenization takes 1.5 s: /health is answered meanwhile, promptly."""
    tok = tiny_llm.tokenizer
    encode = tok.encode
    started = threading.Event()

    def slow(text, *a, **k):
        if "slow" in text:
            started.set()
            time.sleep(1.5)
        return encode(text, *a, **k)

    monkeypatch.setattr(tok, "encode", slow)

    async def body(client, front, app):
        job = asyncio.ensure_future(client.post(C, json={"prompt": "slow prompt", "max_tokens": 2, "temperature": 0}))
        while not started.is_set():
            await asyncio.sleep(0.01)
        waits = []
        while not job.done():
            t0 = time.perf_counter()
            r = await client.get("/health")
            waits.append(time.perf_counter() - t0)
            assert r.status_code == 200
            await asyncio.sleep(0.05)
        return await job, waits

    (slow_answer, waits), (free, usable) = run_app(tiny_llm, body)
    assert slow_answer.status_code == 200
    assert len(waits) >= 5 and max(waits) < 0.5, waits
    assert free == usable


def test_body_limit_on_random_sizes_and_chunkings():
    """The middleware alone, over an app that echoes what it read: every body of at most the
    limit arrives whole, byte for byte, however it was chunked (empty chunks, size 1, odd
    sizes, declared or not); every larger one is a 413 and the app never runs."""
    import random

    from hybridkv.protocol.limits import BodyLimit

    rng = random.Random(23)

    async def echo(scope, receive, send):
        got = b""
        while True:
            message = await receive()
            got += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": got})

    async def call(limit: int, body: bytes, sizes: list[int], declare: bool):
        messages = []
        at = 0
        for n in sizes:
            messages.append({"type": "http.request", "body": body[at : at + n], "more_body": True})
            at += n
        messages.append({"type": "http.request", "body": body[at:], "more_body": False})
        headers = [(b"content-length", str(len(body)).encode())] if declare else []
        sent = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await BodyLimit(echo, limit)({"type": "http", "headers": headers}, receive, send)
        return sent[0]["status"], sent[1]["body"]

    for _ in range(300):
        limit = rng.choice([1, 2, 7, 64, 1000, rng.randint(1, 5000)])
        size = max(0, limit + rng.choice([-limit, -1, 0, 0, 1, 2, rng.randint(-limit, limit)]))
        body = bytes(rng.randrange(256) for _ in range(size))
        sizes = [rng.choice([0, 1, 3, rng.randint(0, size + 1)]) for _ in range(rng.randint(0, 6))]
        status, got = asyncio.run(call(limit, body, sizes, rng.random() < 0.5))
        if size <= limit:
            assert (status, got) == (200, body)
        else:
            assert status == 413 and json.loads(got)["error"]["code"] == "request_too_large"
