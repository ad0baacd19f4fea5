"""hybridkv's KVCacheManager side by side with vLLM 0.33.0's v1 KVCacheManager.

One process, both managers, the same seeded traces (``_traces.py``), played side
by side: 10 scheduling steps of one, then 10 of the other (A B B A A B ...; the
order flips every slice and every round) so load on this shared machine cancels.
Prints, per trace, µs per scheduling step for each manager, the ratio
hybridkv / vLLM (median over rounds) and the prefix-cache hit tokens of each
(they must be equal: same semantics), in two lanes side by side: *plain* (the
manager calls) and *sched* (the managers used as vLLM's scheduler uses them:
prompt hashing of arriving requests timed, the new block ids of each running
request and the whole table of each admitted one read; see ``_traces.py``). Then a step-by-step semantics check
(untimed) of every trace in both free-queue modes, and optionally a randomised
differential fuzz on tiny configs.

Set-up (benchmark-only environment; never a dependency of hybridkv, never in CI)::

    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0
    .venv-vllm/bin/pip install --no-deps -r ../shared/bench/vllm-anchor-requirements.txt

Run (from the repository root)::

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py            # ~2-3 min
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py --quick    # ~20-40 s
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py --check-only --fuzz 300
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vs_vllm.py --state [--quick]  # state groups (~2 min)

``--state``: the Qwen3-Next traces of ``_state_trace.py`` (1 full + 3 Gated DeltaNet state
groups, MambaSpec "align" mode in vLLM) at retention 0 and None, each side with its own
scheduler rules (chunk alignment with the step budget, the shared-prefix junction), timed like
the others, then checked step by step (``_vllm_state.py``: also junctions, every chunk and the
cached positions per group) at blocks 544 and 16, and the junction's effect on hits measured
apart.

Semantics check modes:

* ``exact``: vLLM with its free queue patched to plain LRU (every freed block
  appended at the tail) against hybridkv with ``uncached_first=False`` (plain
  LRU). Same calls, same order: block ids must be identical at every step.
* ``native``: vLLM 0.33 as shipped against hybridkv's default free queue, with
  one manager per group (``stripe_groups=False``, as vLLM has). vLLM 0.33's
  ``BlockPool.free_blocks`` already prepends freed *uncached* blocks
  (``prepend_n``) and appends cached ones, i.e. it is uncached-first too, only the
  order among the prepended uncached blocks differs (vLLM keeps each call's order,
  hybridkv reverses it). Uncached free blocks are interchangeable, so the two
  states must be equal up to a relabelling of block ids: hit tokens, free
  counts, table lengths and null positions must match, and the id map between
  the two must be a bijection at every checkpoint.
* ``striped``: hybridkv's defaults (groups of one spec hold stripes) against
  vLLM as shipped: the same checks except the cached-block count. A stripe is
  evicted whole (its other members could never hit without it) and a request's
  stripes are freed position by position, where vLLM frees group by group; so
  under memory pressure hybridkv keeps fewer useless cached blocks, and it may
  keep more hits (a disagreement on hit tokens then shows which side hit more).

vLLM features that would change hits are left at their plain-v1 defaults:
``watermark=0``, ``full_sequence_must_fit=False``, no EAGLE, no KV connector,
``prefix_cache_retention_interval=None`` (dense: SWA ``reachable_block_mask``
returns None, every full block is cached), ``num_in_flight_tokens=0`` (no async
scheduling), hash ``sha256`` for both (vLLM: pickle + sha256; hybridkv: int64
bytes + sha256).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)
from _vllm_env import import_vllm  # noqa: E402



def _import_vllm():
    import_vllm("vs_vllm.py", "vllm.v1.core.kv_cache_manager", " [--quick]")


from _traces import (  # noqa: E402
    TRACES,
    Driver,
    HybridLane,
    NullLane,
    TraceSpec,
    make_fuzz_trace,
    make_trace,
    median,
    run_interleaved,
)

from _vllm_lanes import SLICE, Mismatch, PairLane, VllmLane, patch_vllm_chunked_retry  # noqa: E402


MODES = ("exact", "native", "striped")


def run_check(tr: TraceSpec, mode: str, full_every: int, per_call_tables: bool = True, deep_every: int = 1) -> dict:
    exact = mode == "exact"
    a = HybridLane(uncached_first=not exact, stripe_groups=mode == "striped")
    b = VllmLane(plain_lru=exact)
    pair = PairLane(a, b, exact=exact, full_every=full_every, per_call_tables=per_call_tables, deep_every=deep_every,
                    compare_cached=mode != "striped")
    d = Driver(tr, pair, hook=pair.hook)
    t = time.perf_counter()
    out = {"trace": tr.name, "mode": mode, "ok": True, "error": ""}
    try:
        res = d.run()
        out.update(steps=res.steps, preemptions=res.preemptions, admitted=res.admitted, finished=res.finished)
    except Mismatch as exc:
        out.update(ok=False, error=str(exc))
    except Exception as exc:  # an invariant or assertion inside one of the managers
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        out.update(ok=False, error=f"step {pair.step}, {pair.last_op}: {type(exc).__name__}: {exc} "
                                   f"(at {os.path.basename(where.filename)}:{where.lineno})")
    out.update(calls=pair.calls, checkpoints=pair.checkpoints, hits_a=pair.hits_a, hits_b=pair.hits_b,
               seconds=time.perf_counter() - t)
    return out


# --------------------------------------------------------------------------- timing
def timed_run(tr: TraceSpec, lane):
    d = Driver(tr, lane, freeze_gc=True)
    t = time.perf_counter()
    res = d.run()
    res.wall_s = time.perf_counter() - t
    return res


LANES = ("hybridkv", "vllm", "hybridkv+sched", "vllm+sched")


def make_lane(key: str):
    sched = key.endswith("+sched")
    return HybridLane(sched=sched) if key.startswith("hybridkv") else VllmLane(sched=sched)


def _make_trace(name: str, quick: bool):
    if name.startswith("q"):
        from _state_trace import make_state_trace

        return make_state_trace(name, quick=quick)
    return make_trace(name, quick=quick)


def bench(traces, quick: bool, rounds: int, lanes=LANES):
    """Per trace and round: every lane in ``lanes`` plays the trace side by side (run_interleaved),
    the lane order reversed every other round. Ratios are per round (hybridkv / vLLM of one kind)."""
    rows = []
    kinds = [k for k in ("", "+sched") if f"hybridkv{k}" in lanes and f"vllm{k}" in lanes]
    for name in traces:
        t_trace = time.perf_counter()
        tr = _make_trace(name, quick=quick)
        per = {k: [] for k in lanes}
        per_rs = {k: [] for k in lanes}
        hash_us = {k: [] for k in lanes}
        ratios = {k: [] for k in kinds}
        ratios_x = []
        hits = {k: set() for k in lanes}
        extra = {}
        null = timed_run(tr, NullLane())
        null_ns = sum(null.step_ns) / max(1, null.req_steps)
        for r in range(rounds):
            order = list(lanes) if r % 2 == 0 else list(lanes)[::-1]
            res = {o.lane: o for o in run_interleaved([(tr, make_lane(k)) for k in order], SLICE)}
            for key, o in res.items():
                per[key].append(o.us_per_step)
                hash_us[key].append(o.hash_ns / max(1, len(o.step_ns)) / 1e3)
                per_rs[key].append(o.us_per_req_step)
                hits[key].add((o.hit_tokens, o.timed_hit_tokens))
            for k in kinds:
                ratios[k].append(res[f"hybridkv{k}"].us_per_step / res[f"vllm{k}"].us_per_step)
            h, v = res[f"hybridkv{kinds[0]}"], res[f"vllm{kinds[0]}"]
            if "" in kinds:
                drv = null_ns * h.req_steps / max(1, len(h.step_ns)) / 1e3
                ratios_x.append((h.us_per_step - drv) / (v.us_per_step - drv))
            extra = dict(steps=len(h.step_ns), req_steps=h.req_steps, preempt=(h.preemptions, v.preemptions),
                         lookups=(h.lookups, v.lookups), query=h.query_tokens,
                         build_us=(h.build_ns / 1e3 / max(1, h.admitted + h.preemptions),
                                   v.build_ns / 1e3 / max(1, v.admitted + v.preemptions)),
                         init_s=(h.init_ns / 1e9, v.init_ns / 1e9))
            print(f"  [{name}] round {r + 1}/{rounds}: " + "  ".join(
                f"{k} {res[k].us_per_step:8.1f}" for k in lanes) + " us/step  ratio "
                + "  ".join(f"{k or 'plain'} {ratios[k][-1]:.3f}" for k in kinds), flush=True)
        print(f"  [{name}] {time.perf_counter() - t_trace:.0f} s", flush=True)
        rows.append(dict(trace=name, desc=tr.description, shape=tr.shape, per=per, per_rs=per_rs, ratios=ratios,
                         hash_us={k: median(v) for k, v in hash_us.items()},
                         ratios_x=ratios_x, hits=hits, null_us=null_ns / 1e3, kinds=kinds, **extra))
    return rows


TARGET = {"a": 0.5, "b": 0.5, "c": 0.7, "d": 0.7}


def _range(xs) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def print_bench(rows, rounds):
    print()
    print(f"Timing (median of {rounds} rounds; in each round the lanes play the trace side by side, "
          f"{SLICE} steps each in turn, the order flipping every slice and every round; µs per scheduling step)")
    print("  plain: manager calls (+ num_computed / append bookkeeping; appended tokens hashed) as before;")
    print("  sched: as vLLM's scheduler uses the manager: also prompt hashing of arriving requests, new block ids "
          "read for running requests, the whole table for admitted ones")
    hdr = (f"{'trace':5} {'layout':34} {'steps':>5} {'req/step':>8} "
           f"{'plain: hybridkv':>15} {'vLLM':>7} {'ratio':>6} {'(range)':>11} {'ex-drv':>6} "
           f"{'sched: hybridkv':>15} {'vLLM':>7} {'ratio':>6} {'(range)':>11} {'target':>6} "
           f"{'hit tokens (both)':>17} {'equal':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        allhits = {k: sorted(v) for k, v in r["hits"].items()}
        first = next(iter(allhits.values()))
        eq = all(v == first for v in allhits.values()) and len(first) == 1
        cells = []
        for k in ("", "+sched"):
            if k in r["kinds"]:
                cells.append(f"{median(r['per']['hybridkv' + k]):>15.1f} {median(r['per']['vllm' + k]):>7.0f} "
                             f"{median(r['ratios'][k]):>6.3f} {_range(r['ratios'][k]):>11}")
            else:
                cells.append(f"{'-':>15} {'-':>7} {'-':>6} {'-':>11}")
            if k == "":
                cells[-1] += f" {median(r['ratios_x']) if r['ratios_x'] else float('nan'):>6.3f}"
        print(f"{r['trace']:5} {r['shape']:34} {r['steps']:>5} {r['req_steps'] / r['steps']:>8.1f} "
              f"{cells[0]} {cells[1]} {TARGET.get(r['trace'], '-'):>6} {first[0][0]:>17} {'yes' if eq else 'NO':>5}")
    print()
    print("ratio = hybridkv / vLLM per round, median (range over rounds); ex-drv = the plain ratio with the "
          "driver's own cost (null lane) subtracted from both.")
    for r in rows:
        print(f"  {r['trace']}: {r['desc']}; rounds: " + "; ".join(
            f"{k or 'plain'} " + ", ".join(f"{x:.3f}" for x in r["ratios"][k]) for k in r["kinds"])
              + "; us/req-step " + ", ".join(f"{k} {median(v):.2f}" for k, v in r["per_rs"].items())
              + (f"; sched prompt hashing us/step hybridkv {r['hash_us']['hybridkv+sched']:.1f}, "
                 f"vllm {r['hash_us']['vllm+sched']:.1f}" if "+sched" in r["kinds"] else "")
              + f"; driver {r['null_us']:.2f} us/req; preemptions {r['preempt']}; lookups {r['lookups']}; "
              f"request build (untimed in plain) {r['build_us'][0]:.0f} / {r['build_us'][1]:.0f} us; "
              f"init {r['init_s'][0]:.2f} / {r['init_s'][1]:.2f} s")


def print_checks(checks):
    print()
    print("Semantics check (untimed, step by step: hit tokens and blocks per lookup, allocation success, free count "
          "after every call, table lengths per call, every table + cached-block count at checkpoints)")
    hdr = f"{'trace':6} {'mode':7} {'calls':>8} {'checkpts':>8} {'hits hybridkv':>13} {'hits vLLM':>10} {'result':<}"
    print(hdr)
    print("-" * 80)
    for c in checks:
        res = "agree" if c["ok"] else "DISAGREE: " + c["error"]
        print(f"{c['trace']:6} {c['mode']:7} {c['calls']:>8} {c['checkpoints']:>8} {c['hits_a']:>13} "
              f"{c['hits_b']:>10} {res}")


def known_difference(tr: TraceSpec, mode: str = "native") -> str:
    """The documented difference a tiny config can run into ('' if none); see RESULTS.md."""
    tags = []
    if mode == "striped" and len(set(tr.groups)) < len(tr.groups):
        tags.append("S1 stripes under pressure")
    if any(g.kind == "chunked" and g.param % tr.block_size for g in tr.groups):
        tags.append("F1 chunk % block != 0")
    if any(g.kind == "sliding" and g.param == 1 for g in tr.groups):
        tags.append("F2 window 1")
    return " + ".join(tags)


def fuzz(n: int, seed0: int, verbose: bool):
    """Differential fuzz: every seed in both modes; disagreements grouped by known cause."""
    fails = []
    t = time.perf_counter()
    calls = 0
    by_kind: dict[str, int] = {}
    for s in range(seed0, seed0 + n):
        for mode in MODES:
            tr = make_fuzz_trace(s, contiguous=mode == "exact")
            kind = known_difference(tr, mode) or "none"
            by_kind[kind] = by_kind.get(kind, 0) + 1
            c = run_check(tr, mode, full_every=1)
            calls += c["calls"]
            if not c["ok"]:
                fails.append((s, c["mode"], tr, c["error"], kind))
                if verbose:
                    print(f"  seed {s} {c['mode']}: {tr.description}\n    {c['error']}")
    print(f"\nFuzz: seeds {seed0}..{seed0 + n - 1} x {len(MODES)} modes, {calls} compared calls, {len(fails)} disagreements "
          f"({time.perf_counter() - t:.0f} s)")
    for kind in sorted(by_kind):
        k_fails = [f for f in fails if f[4] == kind]
        print(f"  configs with {kind:45}: {len(k_fails):4} disagreements in {by_kind[kind]} runs")
        shown = k_fails if kind == "none" else k_fails[:3]
        for f in shown:
            print(f"    seed {f[0]} {f[1]}: {f[2].description}\n      {f[3].splitlines()[0]}")
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short traces, 2 rounds (~30 s)")
    ap.add_argument("--traces", default="abcd", help="subset of a, b, c, d")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per trace (default 3, --quick 2)")
    ap.add_argument("--lanes", default="both", choices=["both", "plain", "sched"],
                    help="plain: manager calls only; sched: as vLLM's scheduler uses it (default both, side by side)")
    ap.add_argument("--no-check", action="store_true", help="skip the semantics check")
    ap.add_argument("--check-only", action="store_true", help="only the semantics check (and --fuzz)")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="also fuzz N random tiny configs")
    ap.add_argument("--fuzz-seed", type=int, default=0)
    ap.add_argument("--vllm-chunked-fix", action="store_true",
                    help="experiment: patch vLLM's chunked-local hit search with the F1 retry rule")
    ap.add_argument("--state", action="store_true",
                    help="the state-group traces (Qwen3-Next: q0, qn timed; q0, qn, q0s, qns checked) instead")
    ap.add_argument("--vllm-deferral-fix", action="store_true",
                    help="experiment: patch vLLM's MambaManager to defer hits by block, not by hash")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    _import_vllm()
    import vllm

    if args.vllm_chunked_fix:
        patch_vllm_chunked_retry()
        print("NOTE: vLLM's ChunkedLocalAttentionManager.find_longest_cache_hit patched with the F1 retry rule")
    print(f"vLLM {vllm.__version__} imported in {time.perf_counter() - t0:.1f} s; python {sys.version.split()[0]}; "
          f"hybridkv from {os.path.dirname(__import__('hybridkv').__file__)}")
    rounds = args.rounds or (2 if args.quick else 3)
    if args.state:
        return state_main(args, rounds, t0)
    traces = [t for t in args.traces if t in TRACES]
    rows = []
    if not args.check_only:
        lanes = {"both": LANES, "plain": LANES[:2], "sched": LANES[2:]}[args.lanes]
        rows = bench(traces, args.quick, rounds, lanes)
        print_bench(rows, rounds)
    checks = []
    if not args.no_check:
        print("\nsemantics check ...", flush=True)
        for name in traces:
            tr = make_trace(name, quick=True)
            if args.quick:  # same streams and layouts, fewer running requests and steps
                tr.max_running = min(tr.max_running, 32)
                tr.num_blocks = max(tr.num_blocks // 4, 20_000)
                tr.warmup_steps, tr.num_steps = 0, 150
            for mode in MODES:
                c = run_check(tr, mode, full_every=10 if name in "ac" else 5, per_call_tables=True,
                              deep_every=8 if name == "a" else 2)
                checks.append(c)
                print(f"  [{name}] {c['mode']}: {'agree' if c['ok'] else 'DISAGREE'} ({c['seconds']:.0f} s)", flush=True)
        print_checks(checks)
    fails = []
    if args.fuzz:
        fails = fuzz(args.fuzz, args.fuzz_seed, args.verbose)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    unexplained = [f for f in fails if f[4] == "none"]  # disagreements no known difference accounts for
    return 1 if unexplained else 0


def state_main(args, rounds: int, t0: float) -> int:
    from _state_trace import make_state_trace
    from _vllm_state import junction_experiment, patch_vllm_deferral_by_block, print_state_checks, run_state_check

    if args.vllm_deferral_fix:
        patch_vllm_deferral_by_block()
        print("NOTE: vLLM's MambaManager patched to defer same-step hits by block (hybridkv's rule)")
    if not args.check_only:
        lanes = {"both": LANES, "plain": LANES[:2], "sched": LANES[2:]}[args.lanes]
        rows = bench(["q0", "qn"], args.quick, rounds, lanes)
        print_bench(rows, rounds)
    if args.no_check:
        return 0
    print("\nstate semantics check ...", flush=True)
    checks = []
    for name in ("q0", "qn", "q0s", "qns"):
        for mode in MODES:
            c = run_state_check(make_state_trace(name, quick=args.quick), mode)
            checks.append(c)
            ok = "agree" if c["ok"] else "DISAGREE"
            print(f"  [{name}] {mode}: {ok} ({c['seconds']:.0f} s)", flush=True)
    print_state_checks(checks)
    print("\nThe junction's effect (retention 0), each manager alone, with its junction (as both schedulers run) "
          "and without:")
    for name in ("q0", "q0s"):
        for key, r in junction_experiment(make_state_trace(name, quick=args.quick)).items():
            print(f"  {name:3} {key:22} hit tokens {r['hit']:>8} of {r['query']:>8} "
                  f"({r['hit'] / max(1, r['query']):.3f}); admitted {r['admitted']}, finished {r['finished']}, "
                  f"preempted {r['preempt']}, cached blocks {r['cached']}", flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
