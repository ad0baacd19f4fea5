"""``hybridkv serve`` against the offline engine: what the HTTP server costs.

    python3 benchmarks/bench_serve.py [--quick] [--model NAME|DIR] [--concurrency 1,8,32]
                                      [--rounds N] [--prompt-len N] [--max-tokens N] [--threads N]

Two lanes run the same prompts at the same concurrency ``c`` with the same engine settings:

* ``server``: ``hybridkv serve MODEL --port 0`` in a subprocess (started once; its ready line
  ``hybridkv serve: listening on http://HOST:PORT`` on stderr gives the address), driven by
  ``c`` httpx async clients, each streaming ``POST /v1/completions`` (token-id prompt,
  ``"stream": true``, greedy, fixed ``max_tokens``, ``ignore_eos``) and taking the next
  prompt when one ends. TTFT: request sent to first SSE chunk; ITL: gaps between chunks
  (one per engine step and request); output tokens from the final ``usage``.
* ``offline``: :class:`~hybridkv.engine.engine.LLMEngine` in this process (built once, by
  :class:`~hybridkv.engine.llm.LLM`, as the server builds its own): ``c`` requests kept
  in flight with ``add_request`` / ``step_deltas`` (one finishes, the next is added); TTFT
  from ``add_request`` to the first delta, ITL between deltas.

Per round, each ``c`` gets fresh random prompts (so neither lane hits the prefix cache
of an earlier round) run by both lanes, the lane order alternating round by round so
machine drift hits both. Printed per ``c``: requests/s, output tokens/s, TTFT and ITL
p50/p99 (all rounds pooled), and the server's wall time over the offline one (median of
the per-round ratios, and range): the issue's target is <= 1.15x at c = 32. Both
sides use ``--threads`` torch threads (``OMP_NUM_THREADS``); the client's event loop
shares the machine with the server, as a real client on the host would. On a small shared
machine use ``--threads 1``: with every core asked for, one busy core stalls each step
(tiny model, 2 cores, load 3: 9 ms steps became 90-500 ms, on either side).
After the last round the server's ``/metrics`` must count every request it served.

Default: Gemma 3 270M (the bundled GGUF, fp32), prompts of 128 tokens, 64 new tokens,
``2c`` requests (at least 8) per ``c`` and round, 3 rounds after an untimed warm-up.
``--quick``: the tiny random Gemma 3 of the tests (sliding window 12 + full layers, with
the tests' character tokenizer, built in a temp dir), 32-token prompts, 16 new tokens,
``c`` requests (at least 4), 2 rounds: a few seconds.

``--noisy-neighbour`` runs :mod:`_noisy` instead: a well-behaved stream's TTFT and
inter-token p99 alone and beside a hostile client (requests asking for every slot, a
barrage of 8 MB bodies), as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)
from tests.support.tiny_server import make_tiny_dir  # noqa: E402
from tests.support.processes import HybridkvProcess  # noqa: E402

READY_TIMEOUT = 300.0  # model load included
STOP_TIMEOUT = 60.0


@dataclass
class LaneRun:
    """One lane at one concurrency in one round."""

    wall: float
    requests: int
    output_tokens: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Setup:
    model: str
    block_size: int
    max_num_seqs: int
    max_model_len: int
    prompt_len: int
    max_tokens: int

    def serve_args(self) -> list[str]:
        return ["--block-size", str(self.block_size), "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--dtype", "float32"]

    def engine_config(self):
        from hybridkv.engine.engine import EngineConfig

        return EngineConfig(block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                            max_model_len=self.max_model_len, dtype="float32")


# --------------------------------------------------------------------------- server lane
def start_server(setup: Setup, threads: int) -> HybridkvProcess:
    """``python -m hybridkv serve`` in a subprocess, ready (the test suite's harness)."""
    return HybridkvProcess([setup.model, "--port", "0", "--served-model-name", "bench", *setup.serve_args()],
                           command="serve", threads=threads, error=SystemExit, ready_timeout=READY_TIMEOUT,
                           stop_timeout=STOP_TIMEOUT)


async def _stream_one(client, prompt: list[int], max_tokens: int, run: LaneRun) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times: list[float] = []
    tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"server answered {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise SystemExit(f"server error: {obj['error']}")
            if obj["choices"]:
                times.append(time.perf_counter())
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    if tokens != max_tokens or not times:
        raise SystemExit(f"expected {max_tokens} tokens, got {tokens} in {len(times)} chunks")
    run.ttft.append(times[0] - sent)
    run.itl += [b - a for a, b in zip(times, times[1:])]
    run.output_tokens += tokens
    run.requests += 1


async def _server_lane(base_url: str, prompts: list[list[int]], c: int, max_tokens: int) -> LaneRun:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    run = LaneRun(0.0, 0, 0)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                await _stream_one(client, queue.get_nowait(), max_tokens, run)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        run.wall = time.perf_counter() - start
    return run


def server_lane(base_url: str, prompts: list[list[int]], c: int, max_tokens: int) -> LaneRun:
    return asyncio.run(_server_lane(base_url, prompts, c, max_tokens))


def server_request_count(base_url: str) -> float:
    """``vllm:request_success_total`` summed over reasons, from ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm:request_success_total")


# -------------------------------------------------------------------------- offline lane
def offline_lane(engine, prompts: list[list[int]], c: int, max_tokens: int) -> LaneRun:
    from hybridkv.scheduler import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo = list(reversed(prompts))
    run = LaneRun(0.0, 0, 0)
    last: dict[str, float] = {}  # request id -> when it was added / last got tokens
    got: dict[str, int] = {}
    start = time.perf_counter()

    def add() -> None:
        rid = engine.add_request(todo.pop(), sp)
        last[rid] = time.perf_counter()
        got[rid] = 0

    for _ in range(min(c, len(todo))):
        add()
    while last:
        for d in engine.step_deltas():
            now = time.perf_counter()
            if d.new_token_ids:
                (run.ttft if got[d.request_id] == 0 else run.itl).append(now - last[d.request_id])
                got[d.request_id] += len(d.new_token_ids)
                last[d.request_id] = now
            if d.output is not None:
                n = got.pop(d.request_id)
                del last[d.request_id]
                if n != max_tokens:
                    raise SystemExit(f"offline: expected {max_tokens} tokens, got {n}")
                run.output_tokens += n
                run.requests += 1
                if todo:
                    add()
    run.wall = time.perf_counter() - start
    return run


# ------------------------------------------------------------------------------- report
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


def report(c: int, runs: dict[str, list[LaneRun]]) -> float:
    """Print one concurrency's lines; returns the median server/offline wall ratio."""
    for lane, rs in runs.items():
        wall = sum(r.wall for r in rs)
        reqs = sum(r.requests for r in rs)
        toks = sum(r.output_tokens for r in rs)
        ttft = [t for r in rs for t in r.ttft]
        itl = [t for r in rs for t in r.itl]
        print(f"  c={c:<3} {lane:8} {reqs / wall:8.2f} req/s {toks / wall:9.1f} tok/s   "
              f"TTFT p50 {pct(ttft, 50) * 1e3:8.1f} p99 {pct(ttft, 99) * 1e3:8.1f} ms   "
              f"ITL p50 {pct(itl, 50) * 1e3:7.1f} p99 {pct(itl, 99) * 1e3:7.1f} ms")
    ratios = [s.wall / o.wall for s, o in zip(runs["server"], runs["offline"])]
    med = statistics.median(ratios)
    print(f"  c={c:<3} server / offline time: {med:.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    return med


# --------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny test model, short prompts, 2 rounds")
    ap.add_argument("--model", default=None, help="model name, .gguf or directory (default gemma-3-270m)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated (default 1,8,32)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; --quick 2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; --quick 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64; --quick 16)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per concurrency and round (default max(2c, 8); --quick max(c, 4))")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noisy-neighbour", action="store_true",
                    help="instead: a well-behaved stream alone and beside a hostile client (benchmarks/_noisy.py)")
    ap.add_argument("--hostile", default="slots,bodies", help="with --noisy-neighbour: slots, bodies (default both)")
    ap.add_argument("--body-rate", type=float, default=40.0,
                    help="with --noisy-neighbour: 8 MB bodies a second at most (default 40; 0: back to back)")
    args = ap.parse_args(argv)
    if args.noisy_neighbour:
        return noisy_neighbour(args)

    threads = args.threads or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch loads: as the server's process gets it
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    levels = [int(x) for x in args.concurrency.split(",")]
    rounds = args.rounds or (2 if args.quick else 3)
    prompt_len = args.prompt_len or (32 if args.quick else 128)
    max_tokens = args.max_tokens or (16 if args.quick else 64)

    def n_requests(c: int) -> int:
        return args.requests or (max(c, 4) if args.quick else max(2 * c, 8))

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        model = args.model or (str(make_tiny_dir(Path(tmp))) if args.quick else "gemma-3-270m")
        from hybridkv.engine.llm import LLM

        setup = Setup(model, 4 if args.quick else 16, max(levels), prompt_len + max_tokens + 16, prompt_len,
                      max_tokens)
        t0 = time.perf_counter()
        engine = LLM(model, setup.engine_config()).engine  # as the server builds its own
        vocab = engine.model.vocab_size
        print(f"model {model} ({len(engine.grouping.groups)} KV cache groups), load {time.perf_counter() - t0:.1f} s; "
              f"{threads} torch threads; prompts {prompt_len} tokens, {max_tokens} new, greedy, ignore_eos; "
              f"block {setup.block_size}, max_num_seqs {setup.max_num_seqs}, max_model_len {setup.max_model_len}")
        rng = random.Random(args.seed)

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)]

        t0 = time.perf_counter()
        server = start_server(setup, threads)
        print(f"server ready at {server.base_url} in {time.perf_counter() - t0:.1f} s")
        try:
            sent = 0
            for c in levels:  # untimed: first-call costs (batch shapes) on both sides
                warm = prompts(c)
                server_lane(server.base_url, warm, c, max_tokens)
                offline_lane(engine, warm, c, max_tokens)
                sent += c
            runs = {c: {"server": [], "offline": []} for c in levels}
            for r in range(rounds):
                for c in levels:
                    ps = prompts(n_requests(c))
                    order = ("server", "offline") if r % 2 == 0 else ("offline", "server")
                    for lane in order:
                        if lane == "server":
                            runs[c][lane].append(server_lane(server.base_url, ps, c, max_tokens))
                            sent += len(ps)
                        else:
                            runs[c][lane].append(offline_lane(engine, ps, c, max_tokens))
                print(f"round {r + 1}/{rounds} done")
            counted = server_request_count(server.base_url)
            if counted != sent:
                raise SystemExit(f"/metrics counts {counted} finished requests, {sent} were sent")
        except BaseException:
            print(f"server (exit code {server.proc.poll()}) stderr tail:\n{''.join(server.lines)[-3000:]}",
                  file=sys.stderr)
            raise
        finally:
            code = server.stop()
        tail = [line.rstrip() for line in server.lines[-3:]]
        print(f"\n{rounds} rounds, {', '.join(f'c={c}: {n_requests(c)} requests' for c in levels)} per round "
              f"(/metrics counted all {sent}); server exit code {code}, its last lines:")
        for line in tail:
            print(f"  | {line}")
        ratios = {c: report(c, runs[c]) for c in levels}
        if 32 in ratios:
            verdict = "meets" if ratios[32] <= 1.15 else "misses"
            print(f"server overhead at c=32: {ratios[32]:.3f}x the offline time ({verdict} the 1.15x target)")
    return 0


def noisy_neighbour(args) -> int:
    """``--noisy-neighbour``: :mod:`_noisy` against one server (SmolLM2, 64 slots; --quick: the tiny model, 16)."""
    from _noisy import HOSTILE_KINDS, run_noisy

    kinds = [k for k in args.hostile.split(",") if k]
    if not kinds or any(k not in HOSTILE_KINDS for k in kinds):
        raise SystemExit(f"--hostile: a comma-separated list of {HOSTILE_KINDS}, got {args.hostile!r}")
    threads = args.threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-noisy-") as tmp:
        model = args.model or (str(make_tiny_dir(Path(tmp))) if args.quick else "smollm2-135m")
        seqs = 16 if args.quick else 64
        server = HybridkvProcess([model, "--port", "0", "--served-model-name", "bench", "--max-num-seqs", str(seqs),
                                  "--max-model-len", "256" if args.quick else "2048"], command="serve",
                                 threads=threads, error=SystemExit, ready_timeout=READY_TIMEOUT,
                                 stop_timeout=STOP_TIMEOUT)
        print(f"model {model}, max_num_seqs {seqs}, {threads} torch threads; server at {server.base_url}")
        try:
            run_noisy(server, "bench", seqs, args.rounds or (1 if args.quick else 3), args.max_tokens or 16, kinds,
                      args.body_rate)
        finally:
            code = server.stop()
        print(f"server exit code {code}; {server.lines[-1].strip() if server.lines else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
