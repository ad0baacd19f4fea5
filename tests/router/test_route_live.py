"""``hybridkv route`` in front of three ``hybridkv serve`` replicas of a tiny sliding-window
model, all real processes on 127.0.0.1: a seeded multi-turn chat + shared-system-prompt
workload; one replica killed and restarted mid-run. Every request completes or fails
cleanly; the hybrid index routes repeat conversations to where their prefix is."""

from __future__ import annotations

import json
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("zmq")

from tests.support.processes import HybridkvProcess as ServerProcess, wait_until
from tests.support.tiny_server import TinyReplica

pytestmark = pytest.mark.live

SYSTEM = "You are a terse assistant. Answer in few words."


@pytest.fixture
def cluster(tiny_dir):
    replicas = [TinyReplica(tiny_dir) for _ in range(3)]
    router = None
    try:
        for r in replicas:
            r.start(wait=False)  # the three load side by side
        for r in replicas:
            r.proc.wait_ready()
        router = ServerProcess(["--model", str(tiny_dir), "--port", "0", "--health-interval", "0.3",
                                "--max-imbalance", "1",
                                *sum((["--replica", r.spec] for r in replicas), [])], command="route")
        yield router, replicas
    finally:
        for p in [router] + [r.proc for r in replicas]:
            if p is not None:
                p.kill()


def _conversations(seed: int, n: int) -> list[list[dict]]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(4, 10)))}]
            for _ in range(n)]


def _chat(client: httpx.Client, messages: list[dict]) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True})


def test_router_routes_by_hybrid_hits_and_survives_a_replica_restart(cluster):
    router, replicas = cluster
    client = httpx.Client(base_url=router.base_url, timeout=60)
    convs = _conversations(0, 6)
    placed: dict[int, str] = {}
    # turn 1 of each conversation, then its later turns: each should go where its prefix is
    for turn in range(3):
        for i, messages in enumerate(convs):
            r = _chat(client, messages)
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and then {turn}"}]
            where = r.headers["x-hybridkv-replica"]
            if turn == 0:
                placed[i] = where
            else:
                assert where == placed[i], (i, turn)  # its prefix lives there
                assert int(r.headers["x-hybridkv-predicted-hit"]) > 0
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
                    int(r.headers["x-hybridkv-predicted-hit"])  # never predicts what is not there
        time.sleep(0.3)  # events of the turn reach the router
    state = client.get("/router/replicas").json()
    assert all(r["up"] and r["indexed_blocks"] > 0 for r in state["replicas"] if r["requests"])

    # kill one replica mid-run: requests keep completing (on the others) or fail cleanly
    victim = replicas[1]
    victim.proc.proc.send_signal(signal.SIGKILL)
    victim.proc.proc.wait(10)
    statuses = []
    for i, messages in enumerate(convs):
        r = _chat(client, messages)
        statuses.append(r.status_code)
        assert r.status_code == 200 or (r.status_code in (502, 503) and "error" in r.json()), r.text
        if r.status_code == 200:
            assert r.headers["x-hybridkv-replica"] != "r1"
    assert statuses.count(200) >= len(convs) - 1
    assert wait_until(lambda: not client.get("/router/replicas").json()["replicas"][1]["up"], timeout=10)
    assert client.get("/router/replicas").json()["replicas"][1]["indexed_blocks"] == 0

    # restart it on the same ports: it comes back up, empty, and is indexed again
    victim.start()
    assert wait_until(lambda: client.get("/router/replicas").json()["replicas"][1]["up"], timeout=20)
    fresh = _conversations(1, 9)
    with ThreadPoolExecutor(9) as pool:  # at once: --max-imbalance 1 spreads them over all three
        assert [r.status_code for r in pool.map(lambda m: _chat(httpx.Client(base_url=router.base_url, timeout=60), m),
                                                 fresh)] == [200] * 9
    time.sleep(0.5)
    r1 = client.get("/router/replicas").json()["replicas"][1]
    assert r1["requests"] > 0 and r1["indexed_blocks"] > 0
    # one death, counted once: one failure, the index dropped once when it went down and once
    # when its new event stream began, not once per failed probe
    assert r1["failures"] == 1, r1
    assert r1["index_resets"].get("down") == 1 and sum(r1["index_resets"].values()) <= 2, r1
    state = client.get("/router/replicas").json()
    assert all(r["bad_events"] == 0 for r in state["replicas"]), json.dumps(state)
    for p in [r.proc for r in replicas]:
        assert p.stop() == 0
    assert router.stop() == 0


def test_route_bad_options_are_one_line_exit_2(tiny_dir):
    import os
    import subprocess
    import sys

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        for args in ([], ["--replica", "localhost:8000"], ["--replica", "http://h:1,udp://x"],
                     ["--replica", "http://127.0.0.1:1", "--policy", "random"],
                     ["--replica", "http://127.0.0.1:1", "--port", str(busy.getsockname()[1])],
                     ["--replica", "http://127.0.0.1:1", "--model", "/nonexistent"]):
            r = subprocess.run([sys.executable, "-m", "hybridkv", "route", *args], capture_output=True, text=True,
                               timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"))
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("hybridkv route: error:"), \
                (args, r.stderr)
    finally:
        busy.close()
