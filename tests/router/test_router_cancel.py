"""A client that goes away, or a router that stops, closes the request's connection to its
replica, and the replica aborts it: non-streaming requests (polled, ``until_done_or_gone``)
and streams alike; ``in_flight`` goes back to 0 and the outcome is counted once.

In-process over fake replicas (an ASGI call whose client leaves at a set time), then live:
``hybridkv route`` in front of one ``hybridkv serve`` of the tiny model, the client a raw
socket that is closed mid-generation, and a router stopped by SIGTERM mid-request.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from hybridkv.router.replica import ReplicaSpec  # noqa: E402
from hybridkv.router.router import Router, RouterConfig  # noqa: E402
from tests.support.processes import HybridkvProcess, wait_until  # noqa: E402
from tests.support.tiny_server import ENGINE_ARGS  # noqa: E402

# ------------------------------------------------------------------ in-process, fake replicas


class _Replica:
    """A fake replica: ``/health`` answers; a generation never ends (a JSON answer never comes,
    a stream yields a chunk every 20 ms) until the router closes it, which is recorded."""

    def __init__(self) -> None:
        self.cancelled = 0  # non-streaming sends cancelled
        self.closed = 0  # streams closed
        self.started = asyncio.Event()
        self.seen_headers: list[dict] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen_headers.append(dict(request.headers))
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        self.started.set()
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Endless(self))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")  # pragma: no cover


class _Endless(httpx.AsyncByteStream):
    def __init__(self, replica: _Replica) -> None:
        self.replica = replica

    async def __aiter__(self):
        while True:
            yield b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
            await asyncio.sleep(0.02)

    async def aclose(self) -> None:
        self.replica.closed += 1


async def _call(app, path: str, body: dict, leave_after: float) -> list[dict]:
    """One POST through ``app`` (ASGI 2.3, as uvicorn speaks it) whose client disconnects
    ``leave_after`` seconds after its body was sent; the messages the app sent."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"router"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())]}
    loop = asyncio.get_running_loop()
    leave_at: float | None = None
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal leave_at
        if leave_at is None:
            leave_at = loop.time() + leave_after
            return {"type": "http.request", "body": data, "more_body": False}
        if loop.time() < leave_at:  # (is_disconnected() asks with a cancelled scope: no await then)
            await asyncio.sleep(leave_at - loop.time())
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def _run(body):
    """``await body(app, router, replica)`` over one fake replica, the router started and stopped."""
    from hybridkv.router.app import create_router_app

    async def main():
        replica = _Replica()
        router = Router([ReplicaSpec("http://r0:8000")], RouterConfig(policy="least-loaded", health_interval=60),
                        transport=httpx.MockTransport(replica))
        await router.start()
        try:
            return await body(create_router_app(router), router, replica)
        finally:
            await router.stop()

    return asyncio.run(main())


async def _outcomes(app) -> dict[str, float]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        text = (await client.get("/metrics")).text
    found = re.findall(r'hybridkv_router_requests_total\{outcome="(\w+)",replica="r0"\} (\S+)', text)
    return {outcome: float(n) for outcome, n in found}


def test_a_client_leaving_a_non_streaming_request_cancels_it_upstream():
    async def body(app, router, replica):
        start = time.monotonic()
        sent = await _call(app, "/v1/completions", {"prompt": "x", "max_tokens": 3000}, leave_after=0.3)
        return time.monotonic() - start, sent, replica.cancelled, router.replicas[0].in_flight, await _outcomes(app)

    took, sent, cancelled, in_flight, outcomes = _run(body)
    assert took < 2.0  # left at 0.3 s, noticed within a poll (0.25 s)
    assert cancelled == 1 and in_flight == 0
    assert outcomes == {"client_gone": 1.0}
    assert sent[0]["status"] == 499  # that nobody reads


@pytest.mark.parametrize("leave_after", [0.0, 0.3], ids=["before-the-first-chunk", "mid-stream"])
def test_a_client_leaving_a_stream_closes_it_upstream(leave_after):
    async def body(app, router, replica):
        sent = await _call(app, "/v1/completions", {"prompt": "x", "stream": True}, leave_after=leave_after)
        return sent, replica.closed, router.replicas[0].in_flight, await _outcomes(app)

    sent, closed, in_flight, outcomes = _run(body)
    assert closed == 1 and in_flight == 0
    assert outcomes == {"client_gone": 1.0}
    chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert (len(chunks) > 3) == (leave_after > 0)  # mid-stream: chunks went out first


def test_models_pass_the_clients_authorization_on():
    async def body(app, router, replica):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            r = await client.get("/v1/models", headers={"authorization": "Bearer k"})
        return r, replica.seen_headers[-1]

    r, seen = _run(body)
    assert r.status_code == 200 and seen.get("authorization") == "Bearer k"


# ------------------------------------------------------------------ live: route + serve

#: 64 prompts (the most in one request) x 480 tokens (+ 15 in the prompt: max_model_len 512):
#: ~25 s of a 2-core machine's generation, so that one aborted in its first seconds cannot have finished
LONG = {"prompt": ["count with me"] * 64, "max_tokens": 480, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def replica(tiny_dir):
    pytest.importorskip("uvicorn")
    proc = HybridkvProcess([str(tiny_dir), "--port", "0", "--served-model-name", "tiny", *ENGINE_ARGS,
                            "--max-model-len", "512"])
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def router(replica):
    # --shutdown-timeout 0: SIGTERM ends what is in flight at once (the default gives it 30 s)
    proc = HybridkvProcess(["--port", "0", "--health-interval", "0.3", "--replica", replica.base_url,
                            "--shutdown-timeout", "0"], command="route")
    try:
        yield proc
    finally:
        proc.kill()


def _gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    out = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        out[name] = float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))
    aborted = re.search(r'^vllm:request_success_total\{finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    out["aborted"] = float(aborted.group(1)) if aborted else 0.0
    return out


def _busy(base_url: str) -> bool:
    g = _gauges(base_url)
    return g["vllm:num_requests_running"] + g["vllm:num_requests_waiting"] > 0


def _started(replica, sock: socket.socket) -> None:
    """Wait (bounded) until the replica works on the request sent on ``sock``."""
    if not wait_until(lambda: _busy(replica.base_url), timeout=20, interval=0.1):
        sock.settimeout(0.5)
        raise AssertionError(f"the replica never started it; the answer: {sock.recv(1000)!r}")


def _send(base_url: str, body: dict) -> socket.socket:
    """POST /v1/completions on a raw socket (closing it is the client going away)."""
    host, port = base_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def _aborted_since(replica, before: float) -> float:
    return _gauges(replica.base_url)["aborted"] - before


#: of LONG's 64 requests, at least this many must end aborted: the first batch of 16 may
#: have finished on a fast machine, the rest cannot have
MOST = 48


def _drop_and_expect_abort(replica, router, body: dict, read_first: bool) -> float:
    """Send ``body`` through the router, drop the client once the replica works on it (after the
    first bytes of the answer, with ``read_first``); the seconds until the replica is idle."""
    aborted_before = _gauges(replica.base_url)["aborted"]
    sock = _send(router.base_url, body)
    try:
        _started(replica, sock)
        if read_first:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)
    finally:
        sock.close()
    dropped = time.monotonic()
    assert wait_until(lambda: not _busy(replica.base_url), timeout=10, interval=0.05), _gauges(replica.base_url)
    idle_after = time.monotonic() - dropped
    assert _aborted_since(replica, aborted_before) >= MOST  # aborted, not finished
    assert wait_until(lambda: httpx.get(f"{router.base_url}/router/replicas", timeout=5).json()
                      ["replicas"][0]["in_flight"] == 0, timeout=5)
    return idle_after


@pytest.mark.live
def test_a_non_streaming_request_dropped_through_the_router_is_aborted_on_the_replica(replica, router):
    idle_after = _drop_and_expect_abort(replica, router, LONG, read_first=False)
    assert idle_after < 3.0  # two polls (router, replica) and a step: ~0.5 s unloaded
    metrics = httpx.get(f"{router.base_url}/metrics", timeout=5).text
    assert re.search(r'hybridkv_router_requests_total\{outcome="client_gone",replica="r0"\} 1\.0', metrics)


@pytest.mark.live
def test_a_stream_dropped_through_the_router_is_aborted_on_the_replica(replica, router):
    assert _drop_and_expect_abort(replica, router, {**LONG, "stream": True}, read_first=True) < 3.0


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_router_stopped_mid_request_aborts_it_and_tells_the_client(replica, router, stream):
    """SIGTERM to ``hybridkv route --shutdown-timeout 0``: its connections to the replica close at
    once (the replica aborts), the waiting client gets a 503 (a stream: an error event and ``[DONE]``), and the
    router exits by itself."""
    aborted_before = _gauges(replica.base_url)["aborted"]
    sock = _send(router.base_url, {**LONG, "stream": stream})
    answer = b""
    try:
        _started(replica, sock)
        router.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert wait_until(lambda: not _busy(replica.base_url), timeout=10, interval=0.05), _gauges(replica.base_url)
        assert time.monotonic() - stopped < 5.0
        while chunk := sock.recv(65536):  # the router closes the connection once it answered
            answer += chunk
    finally:
        sock.close()
    if stream:
        assert answer.startswith(b"HTTP/1.1 200")
        assert answer.rstrip().endswith(b"data: [DONE]\n\n\r\n0")  # chunked: its last chunk, then the end
        assert b'"the router is shutting down"' in answer
    else:
        assert answer.startswith(b"HTTP/1.1 503") and b'"the router is shutting down"' in answer, answer[:300]
    assert router.proc.wait(10) == 0  # it exits by itself (a second SIGTERM would kill it)
    assert _aborted_since(replica, aborted_before) >= MOST
