"""``--shutdown-timeout`` on ``hybridkv serve`` and ``hybridkv route`` (issue 39): at SIGTERM a
request whose body never finished arriving gets 503 and its connection closes at once;
streams in flight get the timeout (0.3 s here, a tenth of what the 16 streams need), then
each ends with an error event naming the shutdown; the process exits 0 in seconds, with
every block free and no traceback in its log."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest

from tests.support.processes import HybridkvProcess

pytestmark = pytest.mark.live

N = 16  # the servers' --max-num-seqs: all run at once


def _half_request(base_url: str) -> socket.socket:
    """A request promising 1,000 body bytes and sending 10."""
    host, port = base_url.split("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\":")
    return s


def _answer(s: socket.socket, limit: float) -> tuple[bytes, float]:
    """What the server sends before it closes, and when it closed."""
    s.settimeout(limit)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out, time.monotonic()


async def _streams(base_url: str, on_all_started) -> list[tuple[str, str | None]]:
    """``N`` streams of 240 tokens; each one's end: ("length", None) or ("error", its message)."""
    started: set[int] = set()

    async def one(client, i):
        body = {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 240, "ignore_eos": True, "stream": True}
        end = None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    end = ("error", event["error"]["message"])
                elif event["choices"]:
                    started.add(i)
                    if len(started) == N:
                        on_all_started()
                    end = ("length", None) if event["choices"][0]["finish_reason"] == "length" else end
        return end

    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=httpx.Limits(max_connections=N + 2)) as client:
        return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(N))), 60)


def _check_shutdown(proc: HybridkvProcess, target: HybridkvProcess, limit: float) -> list:
    half = _half_request(target.base_url)
    signalled = []

    def on_all_started():
        if not signalled:
            signalled.append(time.monotonic())
            target.proc.send_signal(signal.SIGTERM)

    ends = asyncio.run(_streams(target.base_url, on_all_started))
    answer, closed_at = _answer(half, 10)
    assert signalled, "not every stream started"
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"shutting down" in answer and closed_at - signalled[0] < 3.0
    assert target.proc.wait(limit) == 0
    assert "Traceback" not in target.stderr, target.stderr[-3000:]
    errors = [message for kind, message in ends if kind == "error"]
    assert errors and all("shutting down" in m for m in errors), ends  # the deadline cut them
    assert all(kind in ("length", "error") for kind, _ in ends), ends
    return ends


def test_serve_ends_streams_at_the_deadline_and_closes_half_sent_requests(serve):
    server = serve("--shutdown-timeout", "0.3")
    t0 = time.monotonic()
    _check_shutdown(server, server, 15)
    assert time.monotonic() - t0 < 15
    line = [ln for ln in server.lines if "stopped;" in ln][-1]
    free, _, usable = line.split("stopped; ", 1)[1].split()[:3]
    assert free == usable


def test_route_ends_streams_at_the_deadline_and_closes_half_sent_requests(serve):
    replica = serve()
    router = HybridkvProcess(["--port", "0", "--replica", replica.base_url, "--shutdown-timeout", "0.3"],
                             command="route")
    try:
        _check_shutdown(router, router, 15)
        assert "stopped" in router.stderr
        # the replica aborted what the router dropped: nothing runs there any more
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if httpx.get(f"{replica.base_url}/get_load", timeout=5).json()["load"] == 0:
                break
            time.sleep(0.1)
        assert httpx.get(f"{replica.base_url}/get_load", timeout=5).json()["load"] == 0
    finally:
        router.kill()
