"""Scheduler + KV cache manager overhead per step at 256 running requests, hybrid vs full.

    python3 benchmarks/bench_scheduler.py [--quick] [--rounds N]

Llama-4-Scout-shaped caches (block 16, chunk 8192): the hybrid layout has 1 full +
3 chunked groups; the "full" layout one group (hybrid off). Each run admits 256
requests with 2k-12k-token prompts (shared 8k system prompts), prefills them, then
decodes. Timed: ``schedule()`` + ``update_from_output()`` (the fake runner is not).

Per round both layouts get a fresh scheduler and play side by side in one process,
10 steps of one, then 10 of the other, the order flipping every slice and every
round (A B B A A B ...), so load on a shared machine hits both alike; the GC heap is
frozen once both are built (as vLLM's engine core does after start-up), so a
collection over the pools' blocks does not land in random steps of either. Printed:
per layout the median µs per step, and the ratio hybrid / full of each round
(median and range over rounds).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup  # noqa: E402
from hybridkv.core.kv_cache_manager import KVCacheManager  # noqa: E402
from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec  # noqa: E402
from hybridkv.scheduler import FakeRunner, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

SPEC = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


def configs(num_blocks_hybrid: int) -> dict[str, KVCacheConfig]:
    full = FullAttentionSpec(**SPEC)
    chunk = ChunkedLocalAttentionSpec(**SPEC, attention_chunk_size=8192)
    return {
        "hybrid": KVCacheConfig(num_blocks_hybrid, (KVCacheGroup(full),) + (KVCacheGroup(chunk),) * 3),
        "full": KVCacheConfig(num_blocks_hybrid, (KVCacheGroup(full),)),
    }


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(8192)] for _ in range(4)]
    return [systems[i % 4][: rng.randint(2048, 8192)] + [rng.randrange(32000) for _ in range(rng.randint(16, 4096))]
            for i in range(n)]


SLICE = 10  # steps of one layout before the other's turn (the order flips every slice)


def play(cfg: KVCacheConfig, reqs: list[list[int]], decode_steps: int, out: dict):
    """A generator: builds a scheduler with ``reqs`` added, then plays one step per
    ``next()``, adding the scheduler + manager time of each step to ``out`` (ns and step
    counts per phase: "prefill" until every prompt is computed, then "decode")."""
    kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=32768))
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=256, max_model_len=32768))
    for i, p in enumerate(reqs):
        sched.add_request(f"r{i}", p, SamplingParams(max_tokens=decode_steps + 64))
    runner = FakeRunner()
    perf = time.perf_counter_ns
    yield  # built: the caller may freeze the GC heap now

    def timed_step() -> int:
        """One step; nanoseconds spent in the scheduler + KV cache manager (not the runner)."""
        t0 = perf()
        step = sched.schedule()
        t1 = perf()
        sampled = runner.execute(step)
        t2 = perf()
        sched.update_from_output(step, sampled)
        return (t1 - t0) + (perf() - t2)

    while sched.waiting or any(s.request.num_computed_tokens < s.request.num_tokens - 1 for s in sched.running):
        out["prefill_ns"] += timed_step()
        out["prefill_steps"] += 1
        yield
    for _ in range(decode_steps):
        out["decode_ns"] += timed_step()
        out["decode_steps"] += 1
        if sched.num_running != len(reqs):
            raise SystemExit("every request must stay running (no preemption) for a fair ratio")
        yield
    out["preemptions"] = sched.num_preemptions


def run_round(cfgs: dict[str, KVCacheConfig], reqs, decode_steps: int, first: int) -> dict[str, dict]:
    """Both layouts side by side: SLICE steps each in turn, the order flipping every slice;
    ``first`` picks which layout starts. Returns per layout µs per prefill / decode step."""
    names = list(cfgs)
    names = names[first:] + names[:first]
    outs = {k: dict(prefill_ns=0, prefill_steps=0, decode_ns=0, decode_steps=0, preemptions=0) for k in names}
    gens = {k: play(cfgs[k], reqs, decode_steps, outs[k]) for k in names}
    for g in gens.values():
        next(g)  # build
    gc.collect()
    gc.freeze()
    try:
        live, flip = list(names), False
        while live:
            for k in (live[::-1] if flip else list(live)):
                for _ in range(SLICE):
                    if next(gens[k], StopIteration) is StopIteration:
                        live.remove(k)
                        break
            flip = not flip
    finally:
        gens.clear()
        gc.unfreeze()
    return {k: dict(prefill=o["prefill_ns"] / max(1, o["prefill_steps"]) / 1e3,
                    decode=o["decode_ns"] / max(1, o["decode_steps"]) / 1e3,
                    steps=(o["prefill_steps"], o["decode_steps"]), preemptions=o["preemptions"])
            for k, o in outs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 decode steps, 3 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="default 5, --quick 3")
    args = ap.parse_args()
    n = 256
    rounds = args.rounds or (3 if args.quick else 5)
    decode_steps = 100 if args.quick else 400
    reqs = prompts(n, seed=0)
    cfgs = configs(num_blocks_hybrid=n * (800 + 4 * 520) + 1)
    results: dict[str, list[dict]] = {k: [] for k in cfgs}
    ratios = {"prefill": [], "decode": []}
    t0 = time.perf_counter()
    for r in range(rounds):
        res = run_round(cfgs, reqs, decode_steps, first=r % 2)
        for k, v in res.items():
            if v["preemptions"]:
                raise SystemExit(f"{k}: {v['preemptions']} preemptions; the ratio would be unfair")
            results[k].append(v)
        if res["hybrid"]["steps"] != res["full"]["steps"]:
            raise SystemExit(f"the layouts took different steps: {res['hybrid']['steps']} vs {res['full']['steps']}")
        for phase in ratios:
            ratios[phase].append(res["hybrid"][phase] / res["full"][phase])
        print(f"  round {r + 1}/{rounds}: decode hybrid {res['hybrid']['decode']:7.0f} us/step, full "
              f"{res['full']['decode']:7.0f} us/step, ratio {ratios['decode'][-1]:.3f}  (prefill ratio "
              f"{ratios['prefill'][-1]:.3f}; {time.perf_counter() - t0:.0f} s)", flush=True)
    steps = results["hybrid"][0]["steps"]
    print(f"\nscheduler + KV cache manager, {n} running requests, {steps[0]} prefill + {steps[1]} decode steps, "
          f"{rounds} rounds, both layouts side by side ({SLICE} steps each in turn, order flipping)")
    print(f"{'layout':<8} {'groups':>6} {'prefill us/step':>16} {'decode us/step':>15} {'decode us/req':>14}")
    for name, cfg in cfgs.items():
        pre = statistics.median(x["prefill"] for x in results[name])
        dec = statistics.median(x["decode"] for x in results[name])
        print(f"{name:<8} {len(cfg.groups):>6} {pre:>16.0f} {dec:>15.0f} {dec / n:>14.2f}")
    for phase in ("decode", "prefill"):
        xs = ratios[phase]
        print(f"{phase} overhead ratio hybrid/full: median {statistics.median(xs):.2f} over {rounds} rounds "
              f"(range {min(xs):.2f}-{max(xs):.2f}; rounds " + ", ".join(f"{x:.2f}" for x in xs) + ")")


if __name__ == "__main__":
    main()
