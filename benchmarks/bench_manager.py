"""KV cache manager cost per scheduling step: Llama-4-Scout layout (4 groups) vs one full group.

Two seeded traces from ``_traces.py`` (the same request streams as traces (a) and
(b) of ``vs_vllm.py``), each played on

* ``scout``: 1 full + 3 chunked-local groups (block 16, chunk 8192), the three
  chunked groups sharing one manager in hybridkv;
* ``full``: one full-attention group, same block size and pool size.

The pool is large enough for both layouts to admit, hit and finish exactly the same
requests (hit tokens are printed; they must be equal), so the ratio is the cost
of the extra groups alone. Both layouts play side by side in one process,
10 steps each in turn (the order flips every slice and every round), so load
changes hit both alike; the median over rounds is reported. Only hybridkv is used
(system python3 is fine).

    python3 benchmarks/bench_manager.py            # ~1 min on a busy 2-core machine
    python3 benchmarks/bench_manager.py --quick    # ~15 s

Each layout plays twice: manager calls only (the target), and with the block
ids of every group read after each allocation, as the scheduler does for every
scheduled request (``+ids``): the three chunked groups' ids are built on demand,
so this second ratio shows what a caller that reads them all pays.

Target: scout / full <= 1.5 µs per request-step.
"""

from __future__ import annotations

import argparse
import sys
import time

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)

from _traces import (  # noqa: E402
    Driver,
    HybridLane,
    NullLane,
    full_groups,
    make_trace,
    median,
    run_interleaved,
    scout_groups,
)

SLICE = 10  # steps of one layout before the other's turn (the order flips every slice)

TARGET = 1.5

TRACES = {
    # name: (trace of vs_vllm.py, description, pool size)
    "decode": ("a", "decode-heavy: 256 running, prompts 1k-9k, outputs 500-2500", 440_000),
    "prefix": ("b", "prefix-heavy: 48 running, 16 shared system prompts of 9k-31k tokens", 100_000),
}


def layout_trace(name: str, layout: str, quick: bool):
    base, desc, num_blocks = TRACES[name]
    tr = make_trace(base, quick=quick)
    tr.groups = scout_groups() if layout == "scout" else full_groups()
    tr.num_blocks = num_blocks
    tr.description = desc
    return tr


LANES = ("scout", "full", "scout+ids", "full+ids")


def run(quick: bool, rounds: int, names) -> list[dict]:
    rows = []
    for name in names:
        t0 = time.perf_counter()
        per = {k: [] for k in LANES}
        per_step = {k: [] for k in LANES}
        hits = {k: set() for k in LANES}
        ratios, ratios_ids = [], []
        info = {}
        for r in range(rounds):
            order = LANES if r % 2 == 0 else LANES[::-1]
            lanes = [(layout_trace(name, k.split("+")[0], quick), HybridLane(name=k, read_ids=k.endswith("+ids")))
                     for k in order]
            res = {o.lane: o for o in run_interleaved(lanes, SLICE)}
            for lane, out in res.items():
                per[lane].append(out.us_per_req_step)
                per_step[lane].append(out.us_per_step)
                hits[lane].add(out.hit_tokens)
                info[lane] = out
            ratios.append(res["scout"].us_per_req_step / res["full"].us_per_req_step)
            ratios_ids.append(res["scout+ids"].us_per_req_step / res["full+ids"].us_per_req_step)
            print(f"  [{name}] round {r + 1}/{rounds}: scout {res['scout'].us_per_req_step:7.2f} us/req-step  "
                  f"full {res['full'].us_per_req_step:7.2f} us/req-step  ratio {ratios[-1]:.3f}  "
                  f"(+ids {ratios_ids[-1]:.3f})", flush=True)
        null = Driver(layout_trace(name, "full", quick), NullLane()).run()
        s, f = info["scout"], info["full"]
        rows.append(dict(
            name=name, desc=TRACES[name][1], steps=len(s.step_ns), req_per_step=s.req_steps / max(1, len(s.step_ns)),
            us={k: median(v) for k, v in per.items()}, us_step={k: median(v) for k, v in per_step.items()},
            ratio=median(ratios), ratios=ratios, ratio_ids=median(ratios_ids), ratios_ids=ratios_ids,
            hits=(sorted(hits["scout"] | hits["scout+ids"]), sorted(hits["full"] | hits["full+ids"])),
            same=all((info[k].admitted, info[k].finished, info[k].preemptions) == (f.admitted, f.finished, f.preemptions)
                     for k in LANES),
            driver=sum(null.step_ns) / max(1, null.req_steps) / 1e3, seconds=time.perf_counter() - t0,
        ))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short traces (~15 s)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 2)")
    ap.add_argument("--traces", default="decode,prefix")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    names = [n for n in args.traces.split(",") if n in TRACES]
    t0 = time.perf_counter()
    rows = run(args.quick, rounds, names)
    print()
    print(f"hybridkv KVCacheManager, µs per scheduling step per request (median of {rounds} rounds; both layouts "
          f"side by side, {SLICE} steps each in turn, order flipping; manager calls + num_computed/append "
          "bookkeeping, request construction excluded)")
    hdr = (f"{'trace':7} {'steps':>5} {'req/step':>8} {'scout us/req':>12} {'full us/req':>11} {'scout/full':>10} "
           f"{'target':>6} {'+ids scout':>10} {'+ids full':>9} {'+ids ratio':>10} {'hit tokens scout':>16} "
           f"{'hit tokens full':>15} {'same':>4}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        same = r["same"] and r["hits"][0] == r["hits"][1] and len(r["hits"][0]) == 1
        u = r["us"]
        print(f"{r['name']:7} {r['steps']:>5} {r['req_per_step']:>8.1f} {u['scout']:>12.2f} {u['full']:>11.2f} "
              f"{r['ratio']:>10.3f} {TARGET:>6} {u['scout+ids']:>10.2f} {u['full+ids']:>9.2f} {r['ratio_ids']:>10.3f} "
              f"{r['hits'][0][0]:>16} {r['hits'][1][0]:>15} {'yes' if same else 'NO':>4}")
    print()
    for r in rows:
        print(f"  {r['name']}: {r['desc']}; rounds " + ", ".join(f"{x:.3f}" for x in r["ratios"])
              + " (+ids " + ", ".join(f"{x:.3f}" for x in r["ratios_ids"]) + ")"
              + f"; driver's own cost {r['driver']:.2f} us/req-step (included in all); {r['seconds']:.0f} s")
    print("  scout = 1 full + 3 chunked-local(8192) groups (one manager, stripes), full = 1 full group; block 16;")
    print("  +ids = every group's block ids read after each allocation; 'same' = identical admissions, finishes,")
    print("  preemptions and hit tokens in all four lanes")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
