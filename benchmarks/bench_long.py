"""Long context on a CPU: Gemma 3 270M at 4k, 16k and 30k tokens, ours beside llama.cpp.

    PYTHONPATH=src python3 benchmarks/bench_long.py [--parts single,step,capacity] [--lengths 4096,16384,30000]
        [--decode N] [--rounds N] [--lanes int8-hybrid-bf16,int8-hybrid-fp32,int8-full-bf16,llama]
        [--step-rounds N] [--step-tokens N] [--capacity-requests N] [--capacity-kv 256MiB] [--threads N]
        [--json PATH]

Gemma 3 270M (Q4_K_M GGUF: 15 sliding layers of window 512, 3 full ones; context 32,768) on
one prompt of real text (the standard library's docstrings, BOS first), greedy, EOS ignored,
``--threads`` (2) for torch, our kernels and llama.cpp alike. Lanes: ``llama`` (llama.cpp
through its C API, ``_real_env.LlamaCppBatched``: its own Q4_K/Q6_K weights, f16 KV, sliding
layers' caches of their window, 2,048-token batches) and ours, each named
``<precision>-<layout>-<kv>``: precision ``int8`` / ``int4`` (``quantization``), layout
``hybrid`` / ``full`` (``hybrid=False``: every layer's KV kept as full attention), kv the KV
cache's dtype ``fp32`` / ``bf16`` / ``fp16`` (``kv_cache_dtype``). Parts (``--parts``):

* ``single``: per length, each lane one request of that many prompt tokens generating
  ``--decode`` (64) tokens in a fresh engine / context: TTFT (the prefill, 2,048-token
  chunks) and decode tok/s (the tokens after the first / the time after the first). The
  lanes in an order rotated round by round (``--rounds``, 2), the median per lane and the
  ratio against llama.cpp in the same round (median and range).
* ``step``: a decode step's cost, hybrid against all-full, in one process: both engines
  (``int8``, each KV dtype of the lanes) hold the same 4k-token request, then in each of
  ``--step-rounds`` (5) rounds each runs ``--step-tokens`` (256) decode steps, the two
  alternating; per round the ratio of the mean step times, the median of the rounds
  printed (target: within 2 %).
* ``capacity``: one KV budget (``--capacity-kv``, 256 MiB) and ``--capacity-requests`` (8)
  prompts of 4,096 tokens + 256 new each, all arriving at once: the time to the last token
  of ours ``int8`` hybrid and all-full (each KV dtype of the lanes) and llama.cpp with as
  many sequences (its own f16 cache, not budgeted), and our peak running requests.

Targets (issue 35; printed, never asserted): decode >= 1.3x llama.cpp at 4k, 16k, 30k
(int8, bf16 KV), TTFT <= 0.5x llama.cpp at 16k and 30k, the capacity workload hybrid <=
0.5x all-full's time and <= 0.5x llama.cpp's, hybrid step cost within 2 % of all-full's.
Without ``llama_cpp`` importable (see ``_real_env``) its lane and ratios are skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import _paths  # noqa: F401  (this checkout's src importable)
import torch
from _real_env import (LlamaCppBatched, Workload, corpus_text, cpu_description, llama_cpp_lane, make_workload,
                       model_gguf, print_table, ratio_cell, spread, target_cell)

from hybridkv.checkpoint.gguf_file import GGUFFile
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.models import load_model
from hybridkv.sampling_params import SamplingParams
from hybridkv.tokenizer import tokenizer_from_gguf

MODEL = "gemma-3-270m"
KV_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_LANES = "int8-hybrid-bf16,int8-hybrid-fp32,int8-full-bf16,llama"
#: the issue's targets (printed beside the ratios, never asserted): (op, ratio)
DECODE_TARGET = (">=", 1.3)  # vs llama.cpp, int8 lanes with a bf16 cache, at every length
TTFT_TARGET = ("<=", 0.5)  # vs llama.cpp, from TTFT_TARGET_FROM tokens on
TTFT_TARGET_FROM = 16384
CAPACITY_TARGET = ("<=", 0.5)  # hybrid / all-full and hybrid / llama.cpp
STEP_TARGET = ("<=", 1.02)  # hybrid / all-full decode step


def lane_config(name: str) -> tuple[str, bool, str, str]:
    """``int8-hybrid-bf16`` -> ("int8", True, "bfloat16", "all"); a ``-tail`` suffix: ``--kv-store tail``."""
    try:
        quant, layout, kv, *store = name.split("-")
        if quant not in ("int8", "int4") or layout not in ("hybrid", "full") or store not in ([], ["tail"]):
            raise ValueError
        return quant, layout == "hybrid", KV_NAMES[kv], "tail" if store else "all"
    except (ValueError, KeyError):
        raise SystemExit(f"bench_long: a lane is llama or <int8|int4>-<hybrid|full>-<fp32|bf16|fp16>[-tail], "
                         f"got {name!r}")


class Ours:
    """One of our lanes: the model (shared per precision) and a fresh engine per run."""

    def __init__(self, model, name: str, max_len: int, kv_memory: str | None = None, max_num_seqs: int = 8) -> None:
        quant, hybrid, kv, store = lane_config(name)
        self.name, self.model = name, model
        self.config = EngineConfig(block_size=16, max_model_len=max_len, max_num_seqs=max_num_seqs, quantization=quant,
                                   hybrid=hybrid, kv_cache_dtype=kv, kv_cache_memory=kv_memory, kv_store=store)
        self.peak_running = 0

    def run(self, w: Workload) -> tuple[list[float], list[float], float]:
        """All requests at once: per request (TTFT s, last token s) from the start, and the total."""
        engine = LLMEngine(self.model, self.config)
        gc.collect()
        t0 = time.perf_counter()
        ids = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
               for p, m in zip(w.prompts, w.max_tokens)]
        done, self.peak_running = {}, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                done[o.request_id] = (o, time.perf_counter() - t0)
            self.peak_running = max(self.peak_running, len(engine.scheduler.running))
        total = time.perf_counter() - t0
        if any(done[i][0].num_cached_tokens or done[i][0].num_preemptions for i in ids) and len(ids) == 1:
            raise SystemExit("bench_long: a prefix hit or a preemption in a single-stream run")
        return [done[i][0].first_token_time - t0 for i in ids], [done[i][1] for i in ids], total


class Llama:
    """llama.cpp through its C API, one context of ``n_seq`` sequences of ``max_len``."""

    def __init__(self, llama_cpp, n_seq: int, max_len: int, threads: int) -> None:
        self.lane = LlamaCppBatched(llama_cpp, model_gguf(MODEL), n_seq, max_len, threads)

    def run(self, w: Workload) -> tuple[list[float], list[float], float]:
        t0 = time.perf_counter()
        r = self.lane.run(w)
        return r.ttft, [r.total] * len(w.prompts), time.perf_counter() - t0

    def close(self) -> None:
        self.lane.close()


def single(lanes: dict, prompts: dict[int, list[int]], args) -> dict:
    """Per length and round, each lane's TTFT and decode tok/s (lanes rotated round by round)."""
    rows: dict[int, dict[str, list[dict]]] = {n: {name: [] for name in lanes} for n in prompts}
    names = list(lanes)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n, prompt in prompts.items():
            for name in order:
                ttft, _, total = lanes[name].run(Workload([prompt], [args.decode]))
                fig = {"ttft_s": ttft[0], "decode_tok_s": (args.decode - 1) / (total - ttft[0])}
                rows[n][name].append(fig)
                print(f"  round {r + 1} {n} {name}: TTFT {fig['ttft_s']:.2f} s, decode {fig['decode_tok_s']:.1f} tok/s",
                      flush=True)
    return rows


def report_single(rows: dict) -> dict:
    """Per length: each lane's medians and, beside llama.cpp, its ratios (median and range) with
    the targets that apply (decode: int8 lanes with a bf16 cache; TTFT: from 16k on)."""
    out = {}
    for n, lanes in rows.items():
        print(f"\nsingle stream, {n:,}-token prompt (median of rounds; ratio vs llama.cpp in the same round)")
        table = []
        out[n] = {}
        for name, figs in lanes.items():
            entry = {k: statistics.median(f[k] for f in figs) for k in ("ttft_s", "decode_tok_s")}
            cells = ["", "", "", ""]
            if "llama" in lanes and name != "llama":
                ref = lanes["llama"]
                entry["decode_vs_llama"] = spread([f["decode_tok_s"] / g["decode_tok_s"] for f, g in zip(figs, ref)])
                entry["ttft_vs_llama"] = spread([f["ttft_s"] / g["ttft_s"] for f, g in zip(figs, ref)])
                decode_target = DECODE_TARGET if name.startswith("int8-") and name.endswith("-bf16") else None
                ttft_target = TTFT_TARGET if n >= TTFT_TARGET_FROM else None
                cells = [ratio_cell(entry["ttft_vs_llama"]), target_cell(ttft_target, entry["ttft_vs_llama"]),
                         ratio_cell(entry["decode_vs_llama"]), target_cell(decode_target, entry["decode_vs_llama"])]
            out[n][name] = entry
            table.append([name, f"{entry['ttft_s']:.2f}", f"{entry['decode_tok_s']:.1f}", *cells])
        print_table(["lane", "TTFT s", "decode tok/s", "TTFT vs llama.cpp", "target", "decode vs llama.cpp", "target"],
                    table)
    return out


def step_cost(models: dict, prompt: list[int], kvs: list[str], args) -> dict:
    """Hybrid / all-full decode step time, in one process, alternating rounds (int8)."""
    out = {}
    for kv in kvs:
        engines = {}
        for layout in ("hybrid", "full"):
            lane = Ours(models["int8"], f"int8-{layout}-{kv}", len(prompt) + args.step_rounds * args.step_tokens + 8)
            engine = LLMEngine(lane.model, lane.config)
            engine.add_request(prompt, SamplingParams(max_tokens=args.step_rounds * args.step_tokens + 4,
                                                      ignore_eos=True))
            while not any(d.new_token_ids for d in engine.step_deltas()):  # the prefill, to its first token
                pass
            engines[layout] = engine
        ratios, times = [], {"hybrid": [], "full": []}
        for r in range(args.step_rounds):
            per = {}
            for layout in (("hybrid", "full") if r % 2 == 0 else ("full", "hybrid")):
                engine = engines[layout]
                t0 = time.perf_counter()
                for _ in range(args.step_tokens):
                    engine.step()
                per[layout] = (time.perf_counter() - t0) / args.step_tokens
                times[layout].append(per[layout] * 1e3)
            ratios.append(per["hybrid"] / per["full"])
            print(f"  step round {r + 1} KV {kv}: hybrid {per['hybrid'] * 1e3:.2f} ms, all-full "
                  f"{per['full'] * 1e3:.2f} ms, ratio {ratios[-1]:.3f}", flush=True)
        out[kv] = {"ratio": spread(ratios), "hybrid_ms": statistics.median(times["hybrid"]),
                   "full_ms": statistics.median(times["full"]), "rounds": ratios}
        del engines
        gc.collect()
    report_step(out, len(prompt), args.step_rounds, args.step_tokens)
    return out


def report_step(out: dict, length: int, rounds: int, steps: int) -> None:
    print(f"\ndecode step at {length:,} tokens, int8, hybrid vs all-full ({rounds} alternating rounds of {steps} "
          "steps in one process)")
    print_table(["KV", "hybrid ms", "all-full ms", "hybrid / all-full", "target"],
                [[kv, f"{o['hybrid_ms']:.2f}", f"{o['full_ms']:.2f}", ratio_cell(o["ratio"]),
                  target_cell(STEP_TARGET, o["ratio"])] for kv, o in out.items()])


def capacity(models: dict, w: Workload, kvs: list[str], llama_cpp, args) -> dict:
    """The one-budget workload: our hybrid and all-full layouts, llama.cpp; rounds rotated."""
    max_len = max(map(len, w.prompts)) + max(w.max_tokens)
    lanes = {}
    for kv in kvs:
        hybrid = [f"int8-hybrid-{kv}" + ("-tail" if s == "tail" else "") for s in args.capacity_stores]
        for name in hybrid + [f"int8-full-{kv}"]:
            lanes[name] = Ours(models["int8"], name, max_len, kv_memory=args.capacity_kv, max_num_seqs=len(w.prompts))
    if llama_cpp is not None:
        lanes["llama"] = Llama(llama_cpp, len(w.prompts), max_len, args.threads)
    figs: dict[str, list[dict]] = {name: [] for name in lanes}
    names = list(lanes)
    print(f"capacity: our lanes on {args.capacity_kv} of KV", flush=True)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            ttft, _, total = lanes[name].run(w)
            fig = {"total_s": total, "ttft_mean_s": statistics.fmean(ttft),
                   "peak_running": getattr(lanes[name], "peak_running", len(w.prompts))}
            figs[name].append(fig)
            print(f"  capacity round {r + 1} {name}: {total:.1f} s, peak running {fig['peak_running']}", flush=True)
    if "llama" in lanes:
        lanes["llama"].close()
    return report_capacity(figs, w)


def report_capacity(figs: dict[str, list[dict]], w: Workload) -> dict:
    """Per lane the median time and peak running requests; for each hybrid lane its ratio to the
    all-full lane of its KV dtype and to llama.cpp (median and range over rounds) with the targets."""
    out = {}
    table = []
    for name, runs in figs.items():
        entry = {"total_s": statistics.median(f["total_s"] for f in runs),
                 "peak_running": max(f["peak_running"] for f in runs)}
        cells = ["", "", "", ""]
        if name.startswith("int8-hybrid-"):
            full = figs.get(name.replace("hybrid", "full").removesuffix("-tail"))
            if full:
                entry["vs_full"] = spread([a["total_s"] / b["total_s"] for a, b in zip(runs, full)])
                cells[:2] = [ratio_cell(entry["vs_full"]), target_cell(CAPACITY_TARGET, entry["vs_full"])]
            if "llama" in figs:
                entry["vs_llama"] = spread([a["total_s"] / b["total_s"] for a, b in zip(runs, figs["llama"])])
                cells[2:] = [ratio_cell(entry["vs_llama"]), target_cell(CAPACITY_TARGET, entry["vs_llama"])]
        out[name] = entry
        table.append([name, f"{entry['total_s']:.1f}", str(entry["peak_running"]), *cells])
    print(f"\ncapacity: {len(w.prompts)} prompts of {len(w.prompts[0]):,} + {w.max_tokens[0]} new, all at once "
          "(ours: one KV budget; llama.cpp: its own f16 cache)")
    print_table(["lane", "total s", "peak running", "hybrid / all-full", "target", "hybrid / llama.cpp", "target"],
                table)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="single,step,capacity")
    p.add_argument("--lengths", default="4096,16384,30000")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lanes", default=DEFAULT_LANES)
    p.add_argument("--step-rounds", type=int, default=5)
    p.add_argument("--step-tokens", type=int, default=256)
    p.add_argument("--step-length", type=int, default=4096)
    p.add_argument("--capacity-requests", type=int, default=8)
    p.add_argument("--capacity-length", type=int, default=4096)
    p.add_argument("--capacity-new", type=int, default=256)
    p.add_argument("--capacity-kv", default="256MiB")
    p.add_argument("--capacity-stores", default="all", help="hybrid lanes' --kv-store: all, tail or all,tail")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.lanes = [x for x in args.lanes.split(",") if x]
    args.capacity_stores = [x for x in args.capacity_stores.split(",") if x]
    if not args.capacity_stores or set(args.capacity_stores) - {"all", "tail"}:
        raise SystemExit("bench_long: --capacity-stores takes all, tail or all,tail")
    for name in args.lanes:
        if name != "llama":
            lane_config(name)
    if max(args.lengths) + args.decode > 32768:
        raise SystemExit("bench_long: Gemma 3's context is 32,768 tokens (prompt + --decode)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    llama_cpp = llama_cpp_lane(args.lanes)
    cpu = cpu_description()
    print(f"CPU {cpu['model']} (ISA level {cpu['isa']}), {args.threads} threads, torch {torch.__version__}"
          + (f", llama-cpp-python {llama_cpp.__version__}" if llama_cpp else "") + "; Gemma 3 270M, greedy")
    path = model_gguf(MODEL)
    tok = tokenizer_from_gguf(GGUFFile.open(path).metadata)
    ids, bos = tok.encode(corpus_text(), add_special_tokens=False), tok.bos_token_id
    ours = [n for n in args.lanes if n != "llama"]
    quants = {lane_config(n)[0] for n in ours} | ({"int8"} if {"step", "capacity"} & set(args.parts) else set())
    models = {q: load_model(path, quantization=q) for q in sorted(quants)}
    kvs = list(dict.fromkeys(n.split("-")[2] for n in ours)) or ["bf16"]
    report = {"meta": {"cpu": cpu, "threads": args.threads, "lanes": args.lanes, "targets": {
        "decode vs llama.cpp": DECODE_TARGET, f"TTFT vs llama.cpp from {TTFT_TARGET_FROM}": TTFT_TARGET,
        "capacity": CAPACITY_TARGET, "step hybrid / all-full": STEP_TARGET}}}
    if "single" in args.parts:
        max_len = max(args.lengths) + args.decode
        lanes = {n: Ours(models[lane_config(n)[0]], n, max_len, max_num_seqs=1) for n in ours}
        if llama_cpp is not None:
            lanes["llama"] = Llama(llama_cpp, 1, max_len, args.threads)
        prompts = {n: make_workload(ids, bos, 1, (n, n), (1, 1), seed=3).prompts[0] for n in args.lengths}
        for lane in lanes.values():  # warm-up: first-call costs out of the rounds
            lane.run(Workload([prompts[min(prompts)][:600]], [4]))
        report["single"] = report_single(single(lanes, prompts, args))
        if "llama" in lanes:
            lanes["llama"].close()
    if "step" in args.parts:
        prompt = make_workload(ids, bos, 1, (args.step_length,) * 2, (1, 1), seed=4).prompts[0]
        report["step"] = step_cost(models, prompt, kvs, args)
    if "capacity" in args.parts:
        w = make_workload(ids, bos, args.capacity_requests, (args.capacity_length,) * 2, (args.capacity_new,) * 2,
                          seed=5)
        report["capacity"] = capacity(models, w, kvs, llama_cpp, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
