"""Huge prefixes: adopting and freeing a 256k-1M-token cached prefix, hybridkv vs vLLM 0.33.0.

A request whose prompt is a huge prefix (plus one token) that is entirely in the
prefix cache, used as vLLM's scheduler uses it on admission, then freed::

    blocks, hit = get_computed_blocks(B)          # "lookup": hit == the whole prefix
    new = allocate_slots(B, 1, hit, blocks)       # "adopt": touch every hit block, 1 new block
    get_blocks(B).get_block_ids()                 # "ids": NewRequestData's block table
    ...  B.num_computed_tokens = hit + 1          # (untimed)
    free(B)                                       # "free": every block back to the free queue

Set-up (untimed, per layout and length): a request A with the prefix is prefilled
(``allocate_slots`` in chunks of 8192 tokens) and freed, so the prefix's blocks sit
cached in the free queue (the pool holds every group's blocks of the whole prefix:
nothing is evicted). B is built once and reused (``num_computed_tokens`` reset after
``free``, as a preempted request), so every cycle does the same work. B's prompt
hashing is timed once per round too ("hash", not in the total).

Both managers are built side by side in one process; per round each runs ``--cycles``
cycles, one cycle each in turn (the order flips every cycle), after a warm-up cycle;
GC frozen after set-up. Printed per layout and length: ns per position (a position = one block of
16 tokens of the prefix, i.e. prefix / 16) for each phase, and the ratio
hybridkv / vLLM of lookup + adopt + ids + free per round (median and range).

    PYTHONPATH=src /work/.venv-vllm/bin/python benchmarks/vs_vllm_huge.py             # ~3-5 min
    PYTHONPATH=src /work/.venv-vllm/bin/python benchmarks/vs_vllm_huge.py --quick     # 256k tokens, ~1 min
    PYTHONPATH=src /work/.venv-vllm/bin/python benchmarks/vs_vllm_huge.py --profile scout:1M

``--profile LAYOUT:LEN`` runs cProfile over the cycles of both managers instead and
prints, per manager and phase, the functions with the most own time, as ns and calls
per position (the profiler's per-call cost inflates code with many small calls, vLLM's
more than ours). ``--breakdown LAYOUT:LEN`` wraps the managers' per-request functions
with timers instead (no per-position overhead) and prints their inclusive ns per
position, side by side. Layouts: full (1 full group), scout (1 full + 3 chunked 8192), gemma3
(1 full + 6 sliding 1024); block 16.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import sys
import time
from array import array

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)


from _traces import HybridLane, TraceSpec, full_groups, gemma3_groups, median, scout_groups  # noqa: E402
from _vllm_lanes import VllmLane  # noqa: E402
from vs_vllm import _import_vllm  # noqa: E402

LAYOUTS = {"full": full_groups, "scout": scout_groups, "gemma3": gemma3_groups}
BLOCK = 16
PREFILL_CHUNK = 8192
PHASES = ("lookup", "adopt", "ids", "free")


def parse_len(text: str) -> int:
    """'256k' -> 262144, '1M' -> 1048576, '300000' -> 300000."""
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def fmt_len(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k" if n % 1024 == 0 else str(n)


def prefix_tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [x % 32000 for x in array("H", rng.randbytes(2 * n))]


def trace_for(layout: str, length: int) -> TraceSpec:
    groups = LAYOUTS[layout]()
    per_group = length // BLOCK + 64
    return TraceSpec(name=f"{layout}-{fmt_len(length)}", description="", groups=groups,
                     num_blocks=per_group * len(groups) + 1, max_running=1, token_budget=PREFILL_CHUNK,
                     warmup_steps=0, num_steps=0, requests=None, block_size=BLOCK, max_model_len=1 << 22)


class Side:
    """One manager (through its sched-mode lane) with the prefix cached and B built."""

    def __init__(self, lane, tr: TraceSpec, prefix: list[int]):
        self.lane = lane
        self.name = lane.name.replace("+sched", "")
        lane.build(tr)
        a, _ = lane.make_request("A", prefix)
        lane.hash_request(a)
        done = 0
        while done < len(prefix):
            n = min(PREFILL_CHUNK, len(prefix) - done)
            if lane.alloc(a, n) is None:
                raise SystemExit(f"{self.name}: the pool cannot hold the prefix ({tr.num_blocks} blocks)")
            a.num_computed_tokens += n
            done += n
        lane.free(a)
        self.tokens = prefix + [1]
        self.b = self.build_b()
        lane.hash_request(self.b)
        self.expect_hit = len(prefix)

    def build_b(self):
        b, _ = self.lane.make_request("B", self.tokens)  # not hashed yet (sched-mode lane)
        return b

    def time_hash(self) -> int:
        b = self.build_b()
        t = time.perf_counter_ns()
        self.lane.hash_request(b)
        return time.perf_counter_ns() - t

    def cycle(self, out: dict) -> None:
        lane, b, perf = self.lane, self.b, time.perf_counter_ns
        b.num_computed_tokens = 0
        t0 = perf()
        found = lane.lookup(b)  # vLLM returns more than (blocks, hit)
        t1 = perf()
        blocks, hit = found[0], found[1]
        new = lane.alloc(b, 1, hit, blocks)
        t2 = perf()
        lane.table_ids(b.request_id)
        t3 = perf()
        b.num_computed_tokens = hit + 1
        t4 = perf()
        lane.free(b)
        t5 = perf()
        if hit != self.expect_hit or new is None:
            raise SystemExit(f"{self.name}: hit {hit} of {self.expect_hit} tokens, allocation {new is not None}")
        out["lookup"] += t1 - t0
        out["adopt"] += t2 - t1
        out["ids"] += t3 - t2
        out["free"] += t5 - t4


def sides_for(layout: str, length: int) -> list[Side]:
    tr = trace_for(layout, length)
    prefix = prefix_tokens(length)
    return [Side(HybridLane(sched=True), tr, prefix), Side(VllmLane(sched=True), tr, prefix)]


def measure(layout: str, length: int, rounds: int, cycles: int) -> dict:
    t_start = time.perf_counter()
    sides = sides_for(layout, length)
    positions = length // BLOCK
    per = {s.name: {p: [] for p in (*PHASES, "total", "hash")} for s in sides}
    ratios, ratios_af, ratios_adopt, ratios_free = [], [], [], []
    gc.collect()
    gc.freeze()
    try:
        for s in sides:  # warm-up
            s.cycle(dict.fromkeys(PHASES, 0))
        flip = False
        for r in range(rounds):
            acc = {s.name: dict.fromkeys(PHASES, 0) for s in sides}
            for _ in range(cycles):  # one cycle each in turn, the order flipping every cycle
                for s in (sides[::-1] if flip else sides):
                    s.cycle(acc[s.name])
                flip = not flip
            for s in (sides[::-1] if flip else sides):
                per[s.name]["hash"].append(s.time_hash() / positions)
            flip = not flip
            for name, a in acc.items():
                for p in PHASES:
                    per[name][p].append(a[p] / cycles / positions)
                per[name]["total"].append(sum(a.values()) / cycles / positions)
            h, v = acc["hybridkv"], acc["vllm"]
            ratios.append(sum(h.values()) / sum(v.values()))
            ratios_af.append((h["adopt"] + h["ids"] + h["free"]) / (v["adopt"] + v["ids"] + v["free"]))
            ratios_adopt.append(h["adopt"] / v["adopt"])
            ratios_free.append(h["free"] / v["free"])
    finally:
        gc.unfreeze()
    print(f"  [{layout} {fmt_len(length)}] rounds: total " + ", ".join(f"{x:.3f}" for x in ratios)
          + "; adopt+ids+free " + ", ".join(f"{x:.3f}" for x in ratios_af)
          + "; adopt " + ", ".join(f"{x:.2f}" for x in ratios_adopt)
          + "; free " + ", ".join(f"{x:.2f}" for x in ratios_free)
          + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return dict(layout=layout, length=length, per={k: _median_round(d) for k, d in per.items()}, ratios=ratios,
                ratios_af=ratios_af, ratios_adopt=ratios_adopt, ratios_free=ratios_free)


def _median_round(series: dict[str, list[float]]) -> dict[str, float]:
    """The phases of the round whose total is the median (so the phases add up to the total);
    the hash column's own median."""
    totals = series["total"]
    k = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    out = {p: v[k] for p, v in series.items()}
    out["hash"] = median(series["hash"])
    return out


def print_table(rows, rounds: int, cycles: int) -> None:
    print()
    print(f"Huge cached prefix adopted and freed (ns per position = per block of {BLOCK} prefix tokens; the round "
          f"with the median total of {rounds} rounds x {cycles} cycles, one cycle each in turn, order flipping)")
    hdr = (f"{'layout':7} {'prefix':>6} | " + " ".join(f"{p + ' h/v':>13}" for p in PHASES)
           + f" | {'total h/v':>13} {'ratio':>6} {'(range)':>11} | {'adopt+ids+free':>14} {'(range)':>11} | "
           f"{'hash h/v':>13}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        h, v = r["per"]["hybridkv"], r["per"]["vllm"]
        cells = " ".join(f"{h[p]:>6.0f}/{v[p]:<6.0f}" for p in PHASES)
        print(f"{r['layout']:7} {fmt_len(r['length']):>6} | {cells} | {h['total']:>6.0f}/{v['total']:<6.0f} "
              f"{median(r['ratios']):>6.3f} {min(r['ratios']):>5.2f}-{max(r['ratios']):<5.2f} | "
              f"{median(r['ratios_af']):>14.3f} {min(r['ratios_af']):>5.2f}-{max(r['ratios_af']):<5.2f} | "
              f"{h['hash']:>6.0f}/{v['hash']:<6.0f}")
    print()
    print("h/v = hybridkv / vLLM ns per position (the round with the median total); ratio = hybridkv / vLLM of "
          "lookup + adopt + ids + free per round (median, range); adopt+ids+free = the same without the lookup "
          "(hybridkv keeps id lists as it adopts, vLLM builds them when asked: compare these three together); "
          "hash = the prompt's block hashes (once per round, not in the total)")


def profile(layout: str, length: int, cycles: int, top: int) -> None:
    sides = sides_for(layout, length)
    positions = length // BLOCK
    print(f"\ncProfile, {layout} {fmt_len(length)} ({positions} positions), {cycles} cycles per manager; "
          f"own time per position (ns) and calls per position, per phase")
    gc.collect()
    gc.freeze()
    try:
        for s in sides:
            s.cycle(dict.fromkeys(PHASES, 0))
            lane, b = s.lane, s.b
            profs = {p: cProfile.Profile() for p in PHASES}
            for _ in range(cycles):
                b.num_computed_tokens = 0
                found = profs["lookup"].runcall(lane.lookup, b)
                blocks, hit = found[0], found[1]
                profs["adopt"].runcall(lane.alloc, b, 1, hit, blocks)
                profs["ids"].runcall(lane.table_ids, b.request_id)
                b.num_computed_tokens = hit + 1
                profs["free"].runcall(lane.free, b)
            for p in PHASES:
                st = pstats.Stats(profs[p])
                total = st.total_tt
                print(f"\n  {s.name} {p}: {total / cycles / positions * 1e9:.0f} ns/position under the profiler")
                rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
                for (file, line, func), (cc, nc, tt, ct, _) in rows:
                    where = f"{os.path.basename(file)}:{line}({func})" if line else func
                    print(f"    {tt / cycles / positions * 1e9:8.1f} ns/pos own {ct / cycles / positions * 1e9:8.1f} "
                          f"cum {nc / cycles / positions:8.3f} calls/pos  {where}")
    finally:
        gc.unfreeze()


# Functions timed by --breakdown (called a few times per request, never per position, so
# the timer costs nothing measurable); inclusive times: a function's callees are in it too.
BREAKDOWN = {
    "hybridkv": {
        "hybridkv.core.kv_cache_manager": {"KVCacheManager": ("get_computed_blocks", "allocate_slots",
                                                              "_remember_quiet", "free", "get_block_ids")},
        "hybridkv.core.coordinator": {"KVCacheCoordinator": ("find_hit", "get_num_blocks_to_allocate",
                                                             "save_new_computed_blocks", "allocate_new_blocks",
                                                             "cache_blocks", "remove_skipped_blocks", "free")},
        "hybridkv.core.managers.base": {"AttentionManager": ("_scan", "get_num_blocks_to_allocate",
                                                             "save_new_computed_blocks", "allocate_new_blocks",
                                                             "pop_blocks", "get_block_ids", "_sync")},
        "hybridkv.core.block_pool": {"BlockPool": ("touch", "free_blocks", "get_new_blocks", "get_new_stripes")},
    },
    "vllm": {
        "vllm.v1.core.kv_cache_manager": {"KVCacheManager": ("get_computed_blocks", "allocate_slots", "free",
                                                             "get_block_ids"),
                                          "KVCacheBlocks": ("get_block_ids",)},
        "vllm.v1.core.kv_cache_coordinator": {"KVCacheCoordinator": ("get_num_blocks_to_allocate",
                                                                     "allocate_new_computed_blocks",
                                                                     "allocate_new_blocks", "cache_blocks",
                                                                     "remove_skipped_blocks", "free"),
                                              "HybridKVCacheCoordinator": ("find_longest_cache_hit",),
                                              "UnitaryKVCacheCoordinator": ("find_longest_cache_hit",)},
        "vllm.v1.core.single_type_kv_cache_manager": {
            "SingleTypeKVCacheManager": ("get_num_blocks_to_allocate", "add_local_computed_blocks",
                                         "allocate_new_blocks", "pop_blocks_for_free", "free"),
            "FullAttentionManager": ("find_longest_cache_hit",),
            "SlidingWindowManager": ("find_longest_cache_hit",),
            "ChunkedLocalAttentionManager": ("find_longest_cache_hit",)},
        "vllm.v1.core.block_pool": {"BlockPool": ("touch", "free_blocks", "get_new_blocks")},
    },
}


def _install_timers(spec: dict, acc: dict) -> list:
    """Wrap the listed methods with inclusive timers; returns what to restore."""
    import functools
    import importlib

    undo = []
    for modname, classes in spec.items():
        mod = importlib.import_module(modname)
        for clsname, names in classes.items():
            cls = getattr(mod, clsname, None)
            for name in names:
                raw = cls.__dict__.get(name) if cls is not None else None
                if raw is None:
                    continue
                is_cm = isinstance(raw, classmethod)
                fn = raw.__func__ if is_cm else raw
                key = f"{clsname}.{name}"
                cell = acc.setdefault(key, [0, 0])

                def timed(*a, __fn=fn, __cell=cell, **k):
                    t = time.perf_counter_ns()
                    try:
                        return __fn(*a, **k)
                    finally:
                        __cell[0] += time.perf_counter_ns() - t
                        __cell[1] += 1

                functools.update_wrapper(timed, fn)
                setattr(cls, name, classmethod(timed) if is_cm else timed)
                undo.append((cls, name, raw))
    return undo


def breakdown(layout: str, length: int, rounds: int, cycles: int) -> None:
    """Inclusive time of the managers' per-request functions, ns per position, both sides
    side by side (one cycle each in turn, order flipping), median over rounds."""
    sides = sides_for(layout, length)
    positions = length // BLOCK
    accs = {s.name: {} for s in sides}
    per = {s.name: {} for s in sides}
    phases = {s.name: {p: [] for p in PHASES} for s in sides}
    undo = []
    for s in sides:
        undo += _install_timers(BREAKDOWN[s.name], accs[s.name])
    gc.collect()
    gc.freeze()
    try:
        for s in sides:
            s.cycle(dict.fromkeys(PHASES, 0))
        flip = False
        for _ in range(rounds):
            for acc in accs.values():
                for cell in acc.values():
                    cell[0] = cell[1] = 0
            ph = {s.name: dict.fromkeys(PHASES, 0) for s in sides}
            for _ in range(cycles):
                for s in (sides[::-1] if flip else sides):
                    s.cycle(ph[s.name])
                flip = not flip
            for name, acc in accs.items():
                for key, (ns, n) in acc.items():
                    per[name].setdefault(key, []).append((ns / cycles / positions, n / cycles))
                for p in PHASES:
                    phases[name][p].append(ph[name][p] / cycles / positions)
    finally:
        gc.unfreeze()
        for cls, name, raw in reversed(undo):
            setattr(cls, name, raw)
    print(f"\nbreakdown, {layout} {fmt_len(length)} ({positions} positions), {rounds} rounds x {cycles} cycles, "
          f"one cycle each in turn; inclusive ns per position (median over rounds), calls per cycle")
    for name in per:
        print(f"\n  {name}: " + ", ".join(f"{p} {median(v):.0f}" for p, v in phases[name].items()) + " ns/position")
        rows = sorted(per[name].items(), key=lambda kv: -median([x[0] for x in kv[1]]))
        for key, xs in rows:
            ns = median([x[0] for x in xs])
            if xs[0][1]:
                print(f"    {ns:8.1f} ns/pos  {xs[0][1]:5.1f} calls/cycle  {key}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256k tokens only, 3 rounds x 2 cycles")
    ap.add_argument("--layouts", default="full,scout,gemma3")
    ap.add_argument("--lengths", default=None, help="comma list (default 256k,1M; --quick 256k)")
    ap.add_argument("--rounds", type=int, default=None, help="default 5, --quick 3")
    ap.add_argument("--cycles", type=int, default=None, help="cycles per manager per round (default 3, --quick 2)")
    ap.add_argument("--profile", metavar="LAYOUT:LEN", help="cProfile one layout and length instead of timing")
    ap.add_argument("--top", type=int, default=12, help="functions shown per phase with --profile")
    ap.add_argument("--breakdown", metavar="LAYOUT:LEN",
                    help="inclusive time of each manager function (timers, no profiler), instead of timing")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    _import_vllm()
    import vllm

    print(f"vLLM {vllm.__version__} imported in {time.perf_counter() - t0:.1f} s; python {sys.version.split()[0]}; "
          f"hybridkv from {os.path.dirname(__import__('hybridkv').__file__)}")
    cycles = args.cycles or (2 if args.quick else 3)
    if args.breakdown:
        layout, _, length = args.breakdown.partition(":")
        breakdown(layout, parse_len(length or "1M"), args.rounds or 3, cycles)
        return 0
    if args.profile:
        layout, _, length = args.profile.partition(":")
        profile(layout, parse_len(length or "1M"), cycles, args.top)
        return 0
    lengths = [parse_len(x) for x in (args.lengths or ("256k" if args.quick else "256k,1M")).split(",")]
    rounds = args.rounds or (3 if args.quick else 5)
    rows = [measure(layout, n, rounds, cycles) for n in lengths for layout in args.layouts.split(",")]
    print_table(rows, rounds, cycles)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
