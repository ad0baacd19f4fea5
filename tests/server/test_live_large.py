"""A 20 MB prompt against live ``hybridkv serve`` and ``hybridkv route`` processes: with
the size limit raised so that it gets through, the prompt is refused as too long for the
context without being tokenized, and ``/health`` on both answers within a second the
whole time; the router keeps its replica up."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.processes import HybridkvProcess

from tests.support.tiny_server import ENGINE_ARGS

pytestmark = pytest.mark.live

LIMIT = str(64 * 2**20)
PROMPT_BYTES = 20 * 2**20


def _health_while(base_url: str, post) -> tuple[httpx.Response, list[float]]:
    """Run ``post()`` on a thread; poll ``/health`` until it returns; (its answer, the polls' seconds)."""
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(post()), daemon=True)
    waits: list[float] = []
    with httpx.Client(base_url=base_url, timeout=10) as client:
        thread.start()
        deadline = time.monotonic() + 120
        while thread.is_alive() and time.monotonic() < deadline:
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.05)
    thread.join(10)
    assert out, "the large request did not finish"
    return out[0], waits


def test_a_20mb_prompt_never_stalls_serve_or_route(tiny_dir):
    body = b'{"prompt": "' + b"a" * PROMPT_BYTES + b'", "max_tokens": 2}'
    server = router = None
    try:
        server = HybridkvProcess([str(tiny_dir), "--port", "0", "--served-model-name", "tiny", *ENGINE_ARGS,
                                "--max-request-bytes", LIMIT])
        router = HybridkvProcess(["--model", str(tiny_dir), "--port", "0", "--health-interval", "0.3",
                                "--max-request-bytes", LIMIT, "--replica", server.base_url], command="route")

        for base in (server.base_url, router.base_url):
            def post(base=base):
                return httpx.post(f"{base}/v1/completions", content=body,
                                  headers={"content-type": "application/json"}, timeout=120)

            answer, waits = _health_while(base, post)
            assert answer.status_code == 400, answer.text[:300]
            assert answer.json()["error"]["code"] == "context_length_exceeded"
            assert waits and max(waits) < 1.0, (base, max(waits))

        small = httpx.post(f"{router.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert small.status_code == 200
        [replica] = httpx.get(f"{router.base_url}/router/replicas", timeout=10).json()["replicas"]
        assert replica["up"] and replica["failures"] == 0
    finally:
        for p in (router, server):
            if p is not None:
                p.kill()
