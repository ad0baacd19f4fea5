"""A random hostile mix against live ``hybridkv route`` over two ``hybridkv serve`` replicas, beside
well-behaved streams: extreme sampling values, clients that drop non-streaming and streaming
requests mid-generation, bodies that never finish arriving (to the router and to a replica),
malformed JSON, and one replica killed with SIGKILL mid-run and restarted.

Every well-behaved stream ends complete with the offline engine's greedy text, except one cut
by the kill on the killed replica (then it ends with an error event or a 5xx, never a hang);
every hostile request gets its clean answer (200 for values the API accepts, 400, 408), or a
5xx / error event only when its replica was the one killed; afterwards no replica runs
anything, and each replica (the restarted one too) and the router stop with their pools whole.
Bounded: a fixed number of actions, every socket and request with a timeout.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("zmq")

from tests.support.processes import HybridkvProcess, wait_until  # noqa: E402
from tests.support.tiny_server import TinyReplica, engine_config  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.slow]

PROMPTS = ["hello world", "the quick brown fox", "Zebra 42!", "abc abc abc abc", "one two three four five"]
TIMEOUT = 2  # --request-timeout of every process
NEW = 12


def _running(replica: TinyReplica) -> float | None:
    """The replica's ``vllm:num_requests_running`` gauge (None: no answer)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{replica.http}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def cluster(tiny_dir):
    replicas = [TinyReplica(tiny_dir, "--request-timeout", str(TIMEOUT)) for _ in range(2)]
    router = None
    try:
        for r in replicas:
            r.start(wait=False)
        for r in replicas:
            r.proc.wait_ready()
        router = HybridkvProcess(["--model", str(tiny_dir), "--port", "0", "--health-interval", "0.3",
                                  "--request-timeout", str(TIMEOUT), "--max-imbalance", "1",
                                  *sum((["--replica", r.spec] for r in replicas), [])], command="route")
        yield router, replicas
    finally:
        for p in [router] + [r.proc for r in replicas]:
            if p is not None:
                p.kill()


def _raw(url: str, request: bytes, read_for: float) -> bytes:
    """Send ``request`` on a fresh socket and read what comes back for up to ``read_for`` s."""
    host, port = url.split("//", 1)[1].split(":")
    got = b""
    with socket.create_connection((host, int(port)), timeout=read_for) as s:
        s.sendall(request)
        deadline = time.monotonic() + read_for
        try:
            while time.monotonic() < deadline:
                part = s.recv(65536)
                if not part:
                    break
                got += part
        except (socket.timeout, ConnectionError):
            pass
    return got


def _post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def test_a_random_hostile_mix_leaves_well_behaved_streams_whole(cluster, tiny_dir):
    from hybridkv.engine.llm import LLM
    from hybridkv.scheduler import SamplingParams

    router, replicas = cluster
    offline = {p: o.text for p, o in zip(PROMPTS, LLM(str(tiny_dir), engine_config()).generate(
        PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True)))}
    rng = random.Random(32)
    kinds = ["good"] * 16 + ["numerics"] * 6 + ["drop"] * 4 + ["drop_stream"] * 2 + ["slow_router"] * 2 + \
        ["slow_replica"] * 2 + ["malformed"] * 2
    rng.shuffle(kinds)
    kill_at = len(kinds) // 3
    killed: dict[str, float] = {}
    done = threading.Event()
    started = [0]  # actions begun

    def killer() -> None:
        while not done.is_set() and started[0] < kill_at:
            time.sleep(0.02)
        victim = replicas[1]
        killed["at"] = time.monotonic()
        victim.proc.proc.send_signal(signal.SIGKILL)
        victim.proc.proc.wait(10)
        time.sleep(1.0)
        victim.start(wait=False)
        victim.proc.wait_ready()
        killed["back"] = time.monotonic()

    def act(i: int, kind: str) -> tuple:
        time.sleep(rng.random() * 0.05)
        started[0] += 1
        t0 = time.monotonic()
        prompt = PROMPTS[i % len(PROMPTS)]
        with httpx.Client(base_url=router.base_url, timeout=60) as client:
            if kind == "good":
                with client.stream("POST", "/v1/completions", json={
                        "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                    body = "".join(r.iter_text())
                    return kind, t0, time.monotonic(), r.status_code, r.headers.get("x-hybridkv-replica"), prompt, body
            if kind == "numerics":
                fields = rng.choice([{"temperature": 1e-300}, {"top_p": 5e-324, "temperature": 1.0},
                                     {"temperature": 1.7e308}, {"temperature": 5e-324, "top_k": 1, "seed": 1}])
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, **fields})
                return kind, t0, time.monotonic(), r.status_code, r.headers.get("x-hybridkv-replica"), fields, r.text
            if kind in ("drop", "drop_stream"):
                got = _raw(router.base_url, _post("/v1/completions", {
                    "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": kind == "drop_stream"}),
                    read_for=rng.uniform(0.2, 1.0))
                return kind, t0, time.monotonic(), None, None, None, got
            if kind in ("slow_router", "slow_replica"):
                url = router.base_url if kind == "slow_router" else f"http://127.0.0.1:{replicas[0].http}"
                lying = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" \
                        b"content-length: 500\r\n\r\n{\"prompt\": \"hi\""
                got = _raw(url, lying, read_for=TIMEOUT + 4)
                return kind, t0, time.monotonic(), None, None, url, got
            r = client.post("/v1/completions", content=b"{\"prompt\": [1, 2,", headers={"content-type": "application/json"})
            return kind, t0, time.monotonic(), r.status_code, None, None, r.text

    kill_thread = threading.Thread(target=killer, daemon=True)
    kill_thread.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda ik: act(*ik), enumerate(kinds)))
    finally:
        done.set()
    kill_thread.join(60)
    assert "back" in killed, "the killed replica did not come back"

    def overlaps_kill(t0: float, t1: float) -> bool:
        return t0 <= killed["back"] and t1 >= killed["at"]

    good_ok = 0
    for kind, t0, t1, status, where, what, body in results:
        on_victim = where == "r1" or where is None
        if kind == "good":
            events = [json.loads(b[6:]) for b in body.split("\n\n") if b.startswith("data: {")]
            text = "".join(c.get("text", "") for e in events for c in e.get("choices", []))
            errors = [e for e in events if "error" in e]
            if status == 200 and not errors and body.rstrip().endswith("data: [DONE]"):
                assert text == offline[what], (where, what, text)
                good_ok += 1
            else:  # cut: only by the kill, on the killed replica
                assert on_victim and overlaps_kill(t0, t1), (status, where, body[-500:])
        elif kind == "numerics":
            assert status == 200 or (status in (502, 503) and on_victim and overlaps_kill(t0, t1)), (what, status, body)
        elif kind in ("slow_router", "slow_replica"):
            assert body.startswith(b"HTTP/1.1 408 "), (kind, body[:200])
            assert t1 - t0 < TIMEOUT + 3
        elif kind == "malformed":
            assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert good_ok >= 12, good_ok

    # the restarted replica is routed to again and serves right
    with httpx.Client(base_url=router.base_url, timeout=10) as client:
        assert wait_until(lambda: all(x["up"] for x in client.get("/router/replicas").json()["replicas"]), timeout=20)
    with ThreadPoolExecutor(6) as pool:
        after = list(pool.map(lambda i: act(i, "good"), range(6)))
    assert any(where == "r1" for _, _, _, _, where, _, _ in after)
    for kind, t0, t1, status, where, what, body in after:
        events = [json.loads(b[6:]) for b in body.split("\n\n") if b.startswith("data: {")]
        assert status == 200 and "".join(c.get("text", "") for e in events for c in e["choices"]) == offline[what]

    # nothing runs anywhere once the clients are gone (dropped requests were aborted)
    for r in replicas:
        assert wait_until(lambda r=r: _running(r) == 0, timeout=15), (r.spec, _running(r))
    with httpx.Client(base_url=router.base_url, timeout=10) as client:
        assert wait_until(lambda: all(x["in_flight"] == 0 for x in client.get("/router/replicas").json()["replicas"]),
                          timeout=10)
        assert client.get("/health").status_code == 200
    for r in replicas:
        assert r.proc.stop() == 0, r.proc.stderr[-2000:]  # exit 0: every block of the pool free
        assert "Traceback" not in r.proc.stderr
    assert router.stop() == 0
    assert "Traceback" not in router.stderr
