"""Scheduler + KV cache manager overhead per step at 256 running requests, hybrid vs full.

    python3 benchmarks/bench_scheduler.py [--quick]

Llama-4-Scout-shaped caches (block 16, chunk 8192): the hybrid layout has 1 full +
3 chunked groups; the "full" layout one group (hybrid off). Each run admits 256
requests with 2k-12k-token prompts (shared 8k system prompts), prefills them, then
decodes. Timed: ``schedule()`` + ``update_from_output()`` (the fake runner is not).
Rounds alternate hybrid / full so machine drift cancels; the median is printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

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


def run_once(cfg: KVCacheConfig, reqs: list[list[int]], decode_steps: int) -> tuple[float, float, int]:
    kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=32768))
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=256, max_model_len=32768))
    for i, p in enumerate(reqs):
        sched.add_request(f"r{i}", p, SamplingParams(max_tokens=decode_steps + 64))
    runner = FakeRunner()

    def timed_step() -> int:
        """One step; nanoseconds spent in the scheduler + KV cache manager (not the runner)."""
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        sampled = runner.execute(out)
        t2 = time.perf_counter_ns()
        sched.update_from_output(out, sampled)
        return (t1 - t0) + (time.perf_counter_ns() - t2)

    prefill_ns, steps = 0, 0
    while sched.waiting or any(s.request.num_computed_tokens < s.request.num_tokens - 1 for s in sched.running):
        prefill_ns += timed_step()
        steps += 1
    decode_ns = 0
    for _ in range(decode_steps):
        decode_ns += timed_step()
        assert sched.num_running == len(reqs), "every request must stay running (no preemption) for a fair ratio"
    decode_n = decode_steps
    return prefill_ns / steps / 1e3, decode_ns / decode_n / 1e3, sched.num_preemptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    n = 256
    rounds = args.rounds or (2 if args.quick else 5)
    decode_steps = 100 if args.quick else 400
    reqs = prompts(n, seed=0)
    cfgs = configs(num_blocks_hybrid=n * (800 + 4 * 520) + 1)
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in cfgs}
    for _ in range(rounds):
        for name, cfg in cfgs.items():
            pre, dec, preempt = run_once(cfg, reqs, decode_steps)
            assert preempt == 0
            results[name].append((pre, dec))
    print(f"scheduler + KV cache manager, {n} running requests, {rounds} rounds (median), {decode_steps} decode steps")
    print(f"{'layout':<8} {'groups':>6} {'prefill us/step':>16} {'decode us/step':>15} {'decode us/req':>14}")
    med = {}
    for name, cfg in cfgs.items():
        pre = statistics.median(r[0] for r in results[name])
        dec = statistics.median(r[1] for r in results[name])
        med[name] = dec
        print(f"{name:<8} {len(cfg.groups):>6} {pre:>16.0f} {dec:>15.0f} {dec / n:>14.2f}")
    print(f"decode overhead ratio hybrid/full: {med['hybrid'] / med['full']:.2f}")


if __name__ == "__main__":
    main()
