"""The app in-process (httpx's ASGI transport): OpenAI's shapes, and outputs equal to the
offline engine's on the same tiny model."""

from __future__ import annotations

import json
import logging
import re

from hybridkv.scheduler.interface import SamplingParams

from tests.support.tiny_server import run_app

PROMPTS = ["hello world", "the quick brown fox", "abc abc abc abc abc abc", "Zebra 42!"]


def _events(text: str) -> list:
    """The JSON objects of an SSE body, and "[DONE]"; every event is one ``data:`` line."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_models_and_health(tiny_llm):
    async def body(client, front, app):
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        return models, health.status_code

    (models, health), blocks = run_app(tiny_llm, body)
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 256
    assert health == 200
    assert blocks[0] == blocks[1]


def test_completions_equal_offline_greedy(tiny_llm):
    offline = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=12))

    async def body(client, front, app):
        one = [(await client.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0})).json()
               for p in PROMPTS]
        batch = (await client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0})).json()
        return one, batch

    (one, batch), blocks = run_app(tiny_llm, body)
    for r, o in zip(one, offline):
        assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == "tiny"
        [choice] = r["choices"]
        assert choice["text"] == o.text and choice["finish_reason"] == o.finish_reason
        assert r["usage"]["prompt_tokens"] == len(o.prompt_token_ids)
        assert r["usage"]["completion_tokens"] == len(o.token_ids)
        assert r["usage"]["total_tokens"] == len(o.prompt_token_ids) + len(o.token_ids)
    assert [c["index"] for c in batch["choices"]] == list(range(len(PROMPTS)))
    assert [c["text"] for c in batch["choices"]] == [o.text for o in offline]
    assert batch["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in offline)
    assert blocks[0] == blocks[1]


def test_token_id_prompts(tiny_llm):
    ids = tiny_llm.encode("hello world")
    [offline] = tiny_llm.generate([ids], SamplingParams(max_tokens=6))

    async def body(client, front, app):
        return (await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0})).json()

    r, _ = run_app(tiny_llm, body)
    assert r["choices"][0]["text"] == offline.text


def test_chat_equals_offline_and_streams_the_same_text(tiny_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    [offline] = tiny_llm.generate([messages], SamplingParams(max_tokens=10))

    async def body(client, front, app):
        req = {"messages": messages, "max_tokens": 10, "temperature": 0}
        full = (await client.post("/v1/chat/completions", json=req)).json()
        stream = await client.post("/v1/chat/completions", json={**req, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
        return full, stream.headers["content-type"], stream.text

    (full, ctype, sse), _ = run_app(tiny_llm, body)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": offline.text}
    assert ctype.startswith("text/event-stream")
    events = _events(sse)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == offline.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [offline.finish_reason]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(offline.token_ids)


def test_stream_chunks_follow_the_tokens(tiny_llm):
    """One chunk per engine step with new text; together they are the non-streamed text."""
    async def body(client, front, app):
        req = {"prompt": PROMPTS, "max_tokens": 9, "temperature": 0}
        full = (await client.post("/v1/completions", json=req)).json()
        sse = (await client.post("/v1/completions", json={**req, "stream": True})).text
        return full, sse

    (full, sse), _ = run_app(tiny_llm, body)
    events = _events(sse)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for e in events[:-1]:
        [c] = e["choices"]
        assert c["index"] not in finished, "a chunk after the choice's last one"
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            finished[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert finished == {c["index"]: c["finish_reason"] for c in full["choices"]}


def test_cached_tokens_are_the_prefix_hit(tiny_llm):
    prompt = "a long shared prompt that fills several blocks of four tokens"

    async def body(client, front, app):
        req = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
        first = (await client.post("/v1/completions", json=req)).json()
        second = (await client.post("/v1/completions", json=req)).json()
        return first["usage"], second["usage"]

    (first, second), _ = run_app(tiny_llm, body)
    n = first["prompt_tokens"]
    hit = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < hit < n and hit % 4 == 0  # whole blocks, and never the last prompt token


def test_stop_strings_logprobs_and_seeds(tiny_llm):
    [greedy] = tiny_llm.generate(["hello world"], SamplingParams(max_tokens=12))
    stop = greedy.text[4:6]
    assert stop

    async def body(client, front, app):
        stopped = (await client.post("/v1/completions", json={
            "prompt": "hello world", "max_tokens": 12, "temperature": 0, "stop": [stop]})).json()
        lp = (await client.post("/v1/completions", json={
            "prompt": "hello world", "max_tokens": 5, "temperature": 0, "logprobs": 3})).json()
        seeded = [(await client.post("/v1/completions", json={
            "prompt": "hello world", "max_tokens": 8, "temperature": 1.0, "seed": 7, "top_k": 20})).json()
            for _ in range(2)]
        return stopped, lp, seeded

    (stopped, lp, seeded), _ = run_app(tiny_llm, body)
    c = stopped["choices"][0]
    assert c["text"] == greedy.text[: greedy.text.index(stop)]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    logprobs = lp["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    for value, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert value <= 0 and len(top) <= 3
        assert max(top.values()) == value  # greedy: the chosen token is the most likely one
    assert "".join(logprobs["tokens"]) == lp["choices"][0]["text"]
    assert seeded[0]["choices"][0]["text"] == seeded[1]["choices"][0]["text"]


def test_importing_the_server_package_loads_no_framework_or_torch():
    import subprocess
    import sys

    code = ("import sys, hybridkv.server, hybridkv.server.config, hybridkv.protocol.openai; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'torch', 'zmq', 'prometheus_client') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_engine_failure_is_a_500_without_detail_and_serving_goes_on(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    real = engine.step_deltas
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (2, 5):  # fail mid-request, twice
            raise RuntimeError("secret internal detail")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "step_deltas", flaky)

    async def body(client, front, app):
        plain = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6})
        stream = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "stream": True})
        ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        return plain, stream, ok, front.num_engine_errors

    (plain, stream, ok, errors), (free, usable) = run_app(tiny_llm, body)
    assert errors == 2
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    assert "secret" not in plain.text and "Traceback" not in plain.text
    events = _events(stream.text)
    assert events[-1] == "[DONE]" and any(isinstance(e, dict) and "error" in e for e in events)
    assert "secret" not in stream.text
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert free == usable
    engine.kv.check_invariants()


def test_kv_cache_peek_is_the_hit_a_request_gets(tiny_llm):
    prompt = "peek at a prompt long enough for several blocks"

    async def body(client, front, app):
        before = (await client.post("/kv_cache/peek", json={"prompt": prompt})).json()
        await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        peek = (await client.post("/kv_cache/peek", json={"prompt": prompt})).json()
        again = (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})).json()
        bad = [await client.post("/kv_cache/peek", json=b) for b in ({}, {"prompt": 5}, {"prompt": ["a", "b"]},
                                                                     {"messages": "x"}, {"prompt": [999]})]
        raw = await client.post("/kv_cache/peek", content="{oops", headers={"content-type": "application/json"})
        return before, peek, again, bad, raw

    (before, peek, again, bad, raw), _ = run_app(tiny_llm, body)
    assert before["cached_tokens"] == 0
    assert peek["cached_tokens"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert peek["prompt_tokens"] == again["usage"]["prompt_tokens"]
    assert [r.status_code for r in bad] == [400] * 5 and raw.status_code == 400


def test_engine_requests_are_named_after_their_response_and_log_their_hits(tiny_llm, caplog):
    """The engine's request ids are the response's id + ``-{i}`` (vLLM's naming), so the
    replica's debug line for each finished request (its prefix hit when queued, at its
    first and last admission) joins the response a client or router saw."""
    prompt = "a prompt long enough to fill a few blocks of the cache"

    async def body(client, front, app):
        first = (await client.post("/v1/completions", json={"prompt": [prompt, "other"], "max_tokens": 2})).json()
        again = (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})).json()
        chat = (await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 2, "stream": True})).text
        return first, again, json.loads(chat.split("\n\n")[0][len("data: "):])["id"]

    with caplog.at_level(logging.DEBUG, logger="hybridkv.server"):
        (first, again, chat_id), _ = run_app(tiny_llm, body)
    lines = {}
    for record in caplog.records:
        m = re.fullmatch(r"request (\S+) (\w+): (\d+) prompt tokens; prefix hit (\d+) when queued, (\d+) at admission, "
                         r"(\d+) at the last admission \((\d+) preemptions\); (\d+) output tokens", record.getMessage())
        if m:
            lines[m.group(1)] = m.groups()[1:]
    assert set(lines) == {f"{first['id']}-0", f"{first['id']}-1", f"{again['id']}-0", f"{chat_id}-0"}
    reason, num_prompt, queued, admitted, last, preemptions, num_out = lines[f"{again['id']}-0"]
    assert (reason, int(num_out), int(preemptions)) == ("length", 2, 0)
    assert int(num_prompt) == again["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert int(admitted) == int(last) == cached > 0  # the repeated prompt hit its first run's blocks
    assert int(queued) == 0  # this engine keeps no queued prefix (queued_prefix "none")
