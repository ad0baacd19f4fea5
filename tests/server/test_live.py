"""``hybridkv serve`` as a real process on 127.0.0.1 (ephemeral ports), driven by the official
``openai`` client, sync and async: outputs equal the offline engine's, 64 concurrent streams,
a client killed mid-stream, SIGTERM under load, KV events over ZMQ. Every test is bounded:
servers by the fixture's timeouts, clients by their own."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from hybridkv.scheduler.interface import SamplingParams

from tests.support.processes import wait_until

pytestmark = pytest.mark.live

openai = pytest.importorskip("openai")

PROMPTS = ["hello world", "the quick brown fox", "abc abc abc abc abc abc abc abc", "Zebra 42!", "été мир"]
TIMEOUT = 60.0


def _metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _metric(base_url: str, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, lab), v in _metrics(base_url).items()
               if n == name and all(dict(lab).get(k) == str(v2) for k, v2 in labels.items()))


def _final_blocks(server) -> tuple[int, int]:
    line = [ln for ln in server.lines if "stopped;" in ln][-1]
    free, _, usable = line.split("stopped; ", 1)[1].split()[:3]
    return int(free), int(usable)


def test_openai_client_sync_and_async_equal_offline(serve, tiny_llm):
    offline = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=10))
    chat = [{"role": "user", "content": "say something"}]
    [offline_chat] = tiny_llm.generate([chat], SamplingParams(max_tokens=8))
    server = serve()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    for p, o in zip(PROMPTS, offline):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
        assert r.choices[0].text == o.text and r.choices[0].finish_reason == o.finish_reason
        assert r.usage.completion_tokens == len(o.token_ids)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True) if c.choices)
        assert streamed == o.text
    r = client.chat.completions.create(model="tiny", messages=chat, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == offline_chat.text
    again = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)

    async def async_lane():
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        full = await asyncio.gather(*(aclient.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
                                      for p in PROMPTS))
        stream = await aclient.chat.completions.create(model="tiny", messages=chat, max_tokens=8, temperature=0,
                                                       stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await aclient.close()
        return [r.choices[0].text for r in full], text

    texts, chat_text = asyncio.run(asyncio.wait_for(async_lane(), TIMEOUT))
    assert texts == [o.text for o in offline]
    assert chat_text == offline_chat.text
    assert server.stop() == 0
    free, usable = _final_blocks(server)
    assert free == usable


def _load(base_url: str, n: int, max_tokens, ignore_eos: bool = True, on_first=None):
    """``n`` concurrent streaming completions; per client its text and finish reason (or the error)."""
    async def one(aclient, i):
        text, reason = "", None
        stream = await aclient.completions.create(
            model="tiny", prompt=PROMPTS[i % len(PROMPTS)] + f" {i}", max_tokens=max_tokens(i), temperature=0,
            stream=True, extra_body={"ignore_eos": ignore_eos})
        first = True
        async for c in stream:
            if not c.choices:
                continue
            if first and on_first is not None:
                on_first(i)
            first = False
            text += c.choices[0].text
            reason = c.choices[0].finish_reason or reason
        return text, reason

    async def main():
        limits = httpx.Limits(max_connections=n + 4)
        aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0,
                                     http_client=openai.DefaultAsyncHttpxClient(limits=limits))
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, i) for i in range(n)), return_exceptions=True), 3 * TIMEOUT)
        finally:
            await aclient.close()

    return asyncio.run(main())


def test_64_concurrent_streams_complete_and_free_every_block(serve, tiny_llm):
    n = 64

    def max_tokens(i):
        return 4 + i % 13

    offline = tiny_llm.generate([PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(n)],
                                [SamplingParams(max_tokens=max_tokens(i), ignore_eos=True) for i in range(n)])
    server = serve("--max-num-seqs", "32")  # half of them wait: admission and the queue are exercised
    results = _load(server.base_url, n, max_tokens)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert [r[0] for r in results] == [o.text for o in offline]
    assert all(r[1] == "length" for r in results)
    assert _metric(server.base_url, "vllm:num_requests_running") == 0
    assert _metric(server.base_url, "vllm:num_requests_waiting") == 0
    assert _metric(server.base_url, "vllm:request_success_total") == n
    assert server.stop() == 0
    free, usable = _final_blocks(server)
    assert free == usable


CLIENT = r"""
import sys, httpx
with httpx.stream("POST", sys.argv[1] + "/v1/completions", timeout=60, json={
        "prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
    assert r.status_code == 200, r.read()
    for line in r.iter_lines():
        if line.startswith("data: {"):
            print("first", flush=True)
            sys.stdin.readline()  # hold the stream open until killed
"""


def test_a_client_killed_mid_stream_aborts_its_request(serve):
    server = serve()
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.base_url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "first", "the client got no chunk"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # aborted, not run to its 240 tokens: finished as "abort" with its blocks back
    assert wait_until(lambda: _metric(server.base_url, "vllm:request_success_total", finished_reason="abort") == 1,
                      timeout=20)
    assert _metric(server.base_url, "vllm:num_requests_running") == 0
    assert _metric(server.base_url, "vllm:generation_tokens_total") < 240
    assert server.stop() == 0
    assert _final_blocks(server)[0] == _final_blocks(server)[1]


@pytest.mark.parametrize("mode", ["drain", "abort"])
def test_sigterm_under_load(serve, mode):
    """SIGTERM once every stream has its first chunk: admission closes at once; drain lets
    the streams finish, abort ends each with an error event (the openai SDK raises it); the
    process exits 0 with every block free. (``--drain-timeout``: ``--shutdown-timeout``'s old name.)"""
    n = 12
    server = serve("--shutdown", mode, "--drain-timeout", "60")
    started: set[int] = set()
    signalled = []

    def on_first(i):
        started.add(i)
        if len(started) == n and not signalled:
            signalled.append(time.monotonic())
            server.proc.send_signal(signal.SIGTERM)

    results = _load(server.base_url, n, lambda i: 120, on_first=on_first)
    assert signalled, "not every stream started"
    errors = [r for r in results if isinstance(r, BaseException)]
    if mode == "drain":
        assert not errors, errors[:3]
        assert {r[1] for r in results} == {"length"}
    else:
        assert len(errors) == n and all(isinstance(e, openai.APIError) and "shutting down" in str(e) for e in errors), \
            errors[:3]
    assert server.proc.wait(60) == 0
    assert "stopped;" in server.stderr and "Traceback" not in server.stderr
    free, usable = _final_blocks(server)
    assert free == usable
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(f"{server.base_url}/health", timeout=5)


def test_startup_errors_are_one_line_exit_2(tiny_dir):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        for args in (["--port", str(port)], ["--kv-events", "nonsense://x"], ["--shutdown", "later"],
                     ["--port", "70000"]):
            r = subprocess.run([sys.executable, "-m", "hybridkv", "serve", str(tiny_dir), *args],
                               capture_output=True, text=True, timeout=120, env=env)
            assert r.returncode == 2, (args, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("hybridkv serve: error:"), (args, r.stderr)
    finally:
        busy.close()


def test_kv_events_subscriber_sees_every_stored_block(serve, tiny_llm):
    """``--kv-events``: a ZMQ subscriber sees, in every KV cache group, BlockStored events
    whose token ids are exactly the request's full blocks, chained by parent hash."""
    zmq = pytest.importorskip("zmq")
    from hybridkv.protocol.kv_events import BlockStored, decode_batch

    server = serve("--kv-events", "tcp://127.0.0.1:0")
    endpoint = server.stderr.split("KV events on ", 1)[1].split()[0].rstrip(",")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(endpoint)
    stored: dict[int, list] = {}

    def drain():
        while True:
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.Again:
                return
            for e in decode_batch(payload).events:
                if isinstance(e, BlockStored):
                    stored.setdefault(e.group_idx, []).append(e)

    try:
        deadline = time.monotonic() + 20  # the slow joiner: warm up until events arrive
        while not stored and time.monotonic() < deadline:
            httpx.post(f"{server.base_url}/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 1},
                       timeout=10)
            drain()
        assert stored, "no KV event arrived"
        time.sleep(0.3)
        drain()
        stored.clear()
        prompt = [1] + [7 + (i * 5) % 100 for i in range(29)]  # 30 tokens: 7 full blocks of 4
        r = httpx.post(f"{server.base_url}/v1/completions",
                       json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True}, timeout=30).json()
        assert r["usage"]["completion_tokens"] == 6
        time.sleep(0.3)
        drain()
    finally:
        sub.close(0)
        ctx.term()
    groups = tiny_llm.engine.grouping.groups
    assert sorted(stored) == list(range(len(groups)))
    for gid, events in stored.items():
        tokens = [t for e in events for t in e.token_ids]
        assert tokens[:28] == prompt[:28]  # every full prompt block, in order
        assert len(tokens) % 4 == 0 and len(tokens) <= 36
        hashes = [h for e in events for h in e.block_hashes]
        assert len(hashes) == len(tokens) // 4 and len(set(hashes)) == len(hashes)
        assert events[0].parent_block_hash is None
        for prev, e in zip(events, events[1:]):
            assert e.parent_block_hash == prev.block_hashes[-1]
        spec = groups[gid].spec
        assert events[0].kv_cache_spec_kind == spec.kind
        assert events[0].kv_cache_spec_sliding_window == spec.attention_span
    assert server.stop() == 0
