"""Dynamo's standalone KV indexer over two ``hybridkv serve`` replicas, run inside a network
namespace of its own (``unshare -rn``: only a loopback exists there), because the indexer binds
every interface and has no flag to bind one. Prints one JSON line of what it saw; the checks
are :mod:`tests.interop.test_dynamo_indexer`'s.

1. the replicas start and serve a prompt before the indexer exists (its events are only in
   the replica's replay buffer);
2. the indexer starts late; both replicas are registered with ``POST /register`` (events and
   replay endpoints, block size 16);
3. a request to replica 1 makes the indexer see a sequence gap and replay from 0;
4. a shared-prefix workload alternates between the replicas; after each, the indexer's
   ``/query`` score of every prompt is recorded beside each replica's own ``/kv_cache/peek``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from tests.interop.conftest import MODEL, Process, cached_tokens, shared_prefix_workload, wait_http  # noqa: E402
from tests.support.processes import HybridkvProcess, free_port, wait_until  # noqa: E402

BLOCK = 16


def main() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    ports = [(free_port(), free_port()) for _ in range(2)]
    replicas = [HybridkvProcess([MODEL, "--port", "0", "--max-model-len", "1024", "--num-blocks", "256",
                                 "--kv-events", f"tcp://127.0.0.1:{e}", "--kv-events-replay", f"tcp://127.0.0.1:{r}"])
                for e, r in ports]
    indexer = None
    out: dict = {"queries": []}
    try:
        early = shared_prefix_workload(1)[0] + " An early question."
        url0 = replicas[0].base_url
        out["early_cached"] = [cached_tokens(httpx.post(url0 + "/v1/completions", json={"prompt": early, "max_tokens": 2},
                                                        timeout=60)) for _ in range(2)]
        port = free_port()
        indexer = Process([sys.executable, "-m", "dynamo.indexer", "--block-size", str(BLOCK), "--port", str(port),
                           "--model-name", MODEL])
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health", indexer)
        for i, (e, r) in enumerate(ports):
            reg = httpx.post(base + "/register", timeout=10, json={
                "instance_id": i + 1, "endpoint": f"tcp://127.0.0.1:{e}", "replay_endpoint": f"tcp://127.0.0.1:{r}",
                "model_name": MODEL, "block_size": BLOCK})
            assert reg.status_code < 300, reg.text

        def ids(text: str) -> list[int]:
            return httpx.post(url0 + "/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]

        def record(text: str) -> None:
            scores = httpx.post(base + "/query", json={"token_ids": ids(text), "model_name": MODEL}, timeout=10).json()
            peeks = [httpx.post(r.base_url + "/kv_cache/peek", json={"prompt": text}, timeout=10).json() for r in replicas]
            out["queries"].append({"prompt_tokens": peeks[0]["prompt_tokens"],
                                   "scores": [scores["scores"].get(str(i + 1), {}).get("0", 0) for i in range(2)],
                                   "peeks": [p["cached_tokens"] for p in peeks]})

        time.sleep(1.0)  # the indexer's SUB sockets connect in the background (ZMQ's slow joiner)
        # one more request to replica 0 (storing full blocks: a batch): the indexer sees its stream start
        # past 0 and replays the rest
        httpx.post(url0 + "/v1/completions", json={"prompt": "Something new to say, long enough to fill two blocks. " * 4, "max_tokens": 2}, timeout=60)
        out["replayed"] = wait_until(lambda: "Replay complete" in indexer.output, 15)
        time.sleep(0.3)
        record(early)  # known only through the replay
        prompts = shared_prefix_workload(8)
        for k, prompt in enumerate(prompts):
            httpx.post(replicas[k % 2].base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
            time.sleep(0.5)
            for p in prompts[:k + 1]:
                record(p)
        out["repeat_cached"] = [cached_tokens(httpx.post(replicas[k % 2].base_url + "/v1/completions", timeout=60,
                                                         json={"prompt": p, "max_tokens": 2})) for k, p in enumerate(prompts)]
        out["indexer_errors"] = [line for line in indexer.lines if "Failed to decode" in line][:3]
    finally:
        if indexer is not None:
            indexer.stop()
        for r in replicas:
            out.setdefault("exit_codes", []).append(r.stop())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
