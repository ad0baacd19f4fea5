"""Hit tokens per request on a sliding-window model: ``hybridkv route`` vs vllm-router ``kv_aware``
vs Dynamo's indexer scores, over the same two ``hybridkv serve`` replicas' KV events.

    pip install -e ".[interop]"
    python3 benchmarks/bench_interop.py                      # Gemma 3 270M, 2 replicas
    python3 benchmarks/bench_interop.py --requests 36 --num-blocks 1200

The workload: documents of ~700 tokens (longer than Gemma's 512-token window), each asked
several questions in rounds, interleaved, so that a router must remember where each document
went; the replicas' pools (``--num-blocks``) hold only part of the workload, so blocks are
evicted. Each router gets fresh replicas and the same requests, one at a time:

* ``hybridkv route --policy hybrid``: what it predicts (``x-hybridkv-predicted-hit``) and what the
  replica then reports (``cached_tokens``);
* vllm-router ``--policy kv_aware``: what it credits (its ``KV prefix decision`` log line) and
  what the replica reports;
* Dynamo's standalone indexer, subscribed to the replicas of the ``route`` run: its ``/query``
  score of the chosen replica before each request, beside that request's ``cached_tokens``.

Printed: per router, mean hit tokens per request (the replicas' own count), the mean predicted,
and how often the prediction equals the hit / exceeds it. Dynamo's indexer binds every interface
and vllm-router's metrics port too: the whole run re-executes itself in a network namespace of its
own (``unshare -rn``), where only a loopback exists.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.interop.conftest import Process, wait_http  # noqa: E402
from tests.support.processes import HybridkvProcess, free_port, wait_until  # noqa: E402

DECISION = re.compile(r"KV prefix decision .*? credited_prefix_tokens=(\d+)")
WORDS = ("river stone light paper window garden silver market engine winter bridge orange forest signal "
         "harbor candle letter mirror island thunder velvet meadow copper lantern violet canyon").split()


def workload(n_docs: int, rounds: int, doc_words: int, cut: float, seed: int = 0) -> list[str]:
    """Round r asks each document (shuffled) a question; after the first round, odd documents
    are quoted only up to ``cut`` of their words (a shorter shared prefix: its hit point lies
    where the sliding window's blocks were freed early, first to go when the pool evicts)."""
    rng = random.Random(seed)
    docs = [[rng.choice(WORDS) for _ in range(doc_words)] for _ in range(n_docs)]
    out = []
    for r in range(rounds):
        order = list(range(n_docs))
        rng.shuffle(order)
        for d in order:
            words = docs[d] if r == 0 or d % 2 == 0 else docs[d][:int(cut * doc_words)]
            out.append(f"Document: {' '.join(words)}\nQuestion {r}: what is word {rng.randint(1, 99)}?\nAnswer:")
    return out


def replicas(args) -> list[HybridkvProcess]:
    ports = [(free_port(), free_port()) for _ in range(2)]
    reps = [HybridkvProcess([args.model, "--port", "0", "--max-model-len", "2048", "--num-blocks", str(args.num_blocks),
                             "--kv-events", f"tcp://127.0.0.1:{e}", "--kv-events-replay", f"tcp://127.0.0.1:{r}"],
                            threads=1, error=SystemExit) for e, r in ports]
    for rep, (e, r) in zip(reps, ports):
        rep.events, rep.replay = f"tcp://127.0.0.1:{e}", f"tcp://127.0.0.1:{r}"
    return reps


def cached(resp: httpx.Response) -> int:
    if resp.status_code != 200:
        raise SystemExit(f"request failed: {resp.status_code} {resp.text[:300]}")
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def run_route(args, prompts) -> tuple[list, list, list]:
    reps = replicas(args)
    route = HybridkvProcess(["--port", "0", "--model", args.model, "--policy", "hybrid",
                             *[a for r in reps for a in ("--replica", f"{r.base_url},{r.events},{r.replay}")]],
                            command="route", error=SystemExit)
    idx_port = free_port()
    dynamo = Process([sys.executable, "-m", "dynamo.indexer", "--block-size", "16", "--port", str(idx_port),
                      "--model-name", args.model])
    base = f"http://127.0.0.1:{idx_port}"
    try:
        wait_http(base + "/health", dynamo)
        for i, r in enumerate(reps):
            httpx.post(base + "/register", json={"instance_id": i + 1, "endpoint": r.events, "replay_endpoint": r.replay,
                                                 "model_name": args.model, "block_size": 16}, timeout=10)
        time.sleep(1.0)
        hits, predicted, dyn = [], [], []
        for p in prompts:
            ids = httpx.post(reps[0].base_url + "/tokenize", json={"prompt": p}, timeout=30).json()["tokens"]
            scores = httpx.post(base + "/query", json={"token_ids": ids, "model_name": args.model}, timeout=10).json()
            resp = httpx.post(route.base_url + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=300)
            hits.append(cached(resp))
            predicted.append(int(resp.headers["x-hybridkv-predicted-hit"]))
            # route names replicas r0, r1, ... in --replica order; Dynamo knows them as instances 1, 2, ...
            chosen = int(resp.headers["x-hybridkv-replica"].removeprefix("r")) + 1
            cap = (len(ids) - 1) // 16 * 16
            dyn.append(min(scores["scores"].get(str(chosen), {}).get("0", 0), cap))
            time.sleep(args.settle)
        return hits, predicted, dyn
    finally:
        dynamo.stop()
        route.stop()
        for r in reps:
            r.stop()


def run_vllm_router(args, prompts) -> tuple[list, list]:
    reps = replicas(args)
    port = free_port()
    router = Process(["vllm-router", "--worker-urls", *[r.base_url for r in reps], "--policy", "kv_aware",
                      "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                      "--prometheus-port", str(free_port()), "--log-level", "debug"])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", router)
        wait_until(lambda: router.output.count("spawned subscriber") == 2, 20)
        hits, credited = [], []
        for p in prompts:
            hits.append(cached(httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=300)))
            wait_until(lambda: len(DECISION.findall(router.output)) == len(hits), 10)
            credited.append(int(DECISION.findall(router.output)[-1]))
            time.sleep(args.settle)
        rejected = router.output.count("dense batch rejected")
        return hits, credited, rejected
    finally:
        router.stop()
        for r in reps:
            r.stop()


def summary(name: str, hits: list, predicted: list) -> str:
    n = len(hits)
    eq = sum(p == h for p, h in zip(predicted, hits))
    over = sum(p > h for p, h in zip(predicted, hits))
    return (f"| {name} | {sum(hits) / n:.0f} | {sum(predicted) / n:.0f} | {eq}/{n} | {over}/{n} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--doc-words", type=int, default=600)
    ap.add_argument("--cut", type=float, default=0.6, help="the share of an odd document quoted after round 0")
    ap.add_argument("--num-blocks", type=int, default=1200, help="each replica's KV pool (eviction pressure)")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds after each response (events reach the indexes)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inner:
        if shutil.which("unshare") is None:
            raise SystemExit("bench_interop: needs unshare (a network namespace for Dynamo's indexer)")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
        sys.exit(subprocess.call(["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                                  sys.executable, __file__, *sys.argv[1:], "--inner"], env=env))
    for tool in ("vllm-router",):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench_interop: {tool} is not installed (pip install -e '.[interop]')")
    prompts = workload(args.docs, args.rounds, args.doc_words, args.cut)
    t0 = time.time()
    hits_r, pred_r, dyn = run_route(args, prompts)
    hits_v, cred_v, rejected = run_vllm_router(args, prompts)
    print(f"model {args.model}, 2 replicas x {args.num_blocks} blocks, {len(prompts)} requests "
          f"({args.docs} documents x {args.rounds} rounds, ~{args.doc_words} words each, odd ones cut to "
          f"{args.cut:g} after round 0), {time.time() - t0:.0f} s")
    print("| router | hit tokens / request (replica's count) | predicted / request | predicted = hit | predicted > hit |")
    print("|---|---|---|---|---|")
    print(summary("hybridkv route (hybrid)", hits_r, pred_r))
    print(summary("Dynamo indexer score (same requests as route)", hits_r, dyn))
    print(summary("vllm-router kv_aware", hits_v, cred_v))
    print(f"vllm-router: {rejected} event batches rejected (its 'dense batch rejected': non-full-attention groups)")
    print(json.dumps({"route": [hits_r, pred_r], "dynamo": dyn, "vllm_router": [hits_v, cred_v]}))


if __name__ == "__main__":
    main()
