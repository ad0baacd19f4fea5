"""Speed on real models: hybridkv's engine on the GGUF's own blocks (gguf), fp32, bf16, int8 and int4 vs
llama.cpp, single-stream and 32 concurrent.

    PYTHONPATH=src python3 benchmarks/bench_real.py [--quick] [--models a,b] [--precisions gguf,fp32,bf16,int8,int4]
        [--modes single,concurrent] [--lanes ours,llama,hf] [--rounds N] [--threads N] [--max-prompt N]
        [--max-output N] [--single-requests N] [--single-output N] [--long-prompt N] [--hf-batch N]
        [--json PATH] [--profile]
    PYTHONPATH=src /work/.venv-llamacpp/bin/python benchmarks/bench_real.py      # with the llama.cpp lane

llama.cpp is a benchmark-only environment (``llama-cpp-python`` built from source; never a
dependency, never in CI); its set-up is in ``benchmarks/_real_env.py`` and is printed when
the bindings are absent, in which case the llama.cpp lane is skipped (and so are the ratios).

Models (``--models``, default both): ``gemma-3-270m`` (Q4_K_M GGUF) and ``smollm2-135m``
(SmolLM2-135M-Instruct, Q4_1 GGUF, Llama), taken one after another: every lane of a model
is loaded once before its first round and kept to its last (outside the timed regions),
then freed before the next model.

Lanes (all in this process, ``--threads`` for torch and llama.cpp alike, default 2):

* ``ours-<precision>`` (``--precisions``, default all): ``LLMEngine`` on the GGUF; ``gguf``:
  its quantized blocks run as stored (``quantization="gguf"``, what the default ``auto``
  picks on a CPU: fp32 activations, KV and other tensors); ``fp32``: the weights hybridkv
  dequantizes to fp32 (``quantization="none"``, the exact path); ``bf16``:
  ``dtype="bfloat16"`` (weights, activations and KV in bf16); ``int8`` / ``int4``: fp32
  model and KV, weights re-quantized from the dequantized ones by ``load_model(...,
  quantization=...)`` (int8 per row, int4 group-wise; the kernels take bf16 inputs).
  Continuous batching, chunked prefill (2,048 tokens per step), prefix caching on (the
  prompts share nothing: a hit or a preemption aborts the run), a fresh engine (empty
  prefix cache) per mode and round, built before the clock starts.
* ``llama.cpp`` (``--lanes ... llama``, on by default): its own batching through the C API
  (``_real_env.LlamaCppBatched``: one context, a KV sequence per request, 2,048-token
  batches of 512-token micro-batches, greedy by argmax) on the GGUF's own quantized weights
  (Q4_K/Q6_K resp. Q4_1 kernels, f16 KV); single-stream is the same with one sequence.
* ``hf`` (off by default: at fp32 it takes longer than all other lanes together on 2
  cores): transformers ``generate`` (fp32 from the same GGUF, ``sdpa``); concurrent: the
  requests left-padded in batches of ``--hf-batch`` (default 32: one batch), a batch
  generating its longest count for every row (the extra tokens dropped); single-stream:
  one unpadded ``generate`` per request.

Modes (``--modes``, default both), on seeded slices of the tokenized docstrings of the
Python standard library (each model's own tokenizer, BOS first), greedy, EOS ignored, so
every lane generates exactly the same number of tokens:

* ``single``: ``--single-requests`` (4) requests of 32..512 prompt tokens, one at a time,
  ``--single-output`` (128) tokens each. A request's TTFT counts from its own start to its
  first token (the prefill), its decode time from then to its last token; decode tok/s =
  the tokens after the first / the decode time, summed over the requests. Then one
  ``--long-prompt`` (1,000) token prompt, one token generated: its TTFT ("TTFT long").
* ``concurrent``: 32 requests all arriving at once, prompts of 32..1,500 tokens
  (log-uniform: many short, a few long, several past Gemma's 512-token window), outputs
  of 16..128: throughput = output tokens / the time from the start to the last token;
  TTFT counts from that start (``--max-prompt`` / ``--max-output`` shrink the lengths).

``--quick``: a smoke run of seconds per lane (2 single requests of 32..64 tokens with 8
outputs, a 128-token "long" prompt, 4 concurrent requests of 32..200 tokens with 4..8
outputs, 1 round). ``--profile``: the first ``ours`` lane once on the concurrent
workload under cProfile and once under torch.profiler, instead of the rounds.

Timing: every lane first runs a short warm-up (first-call costs out of the rounds). Per
round the lanes run in an order rotated round by round, all of single-stream, then all of
concurrent. Each table gives per lane the median over rounds, and the ratio against
llama.cpp in the same round (tok/s: ours / llama.cpp, > 1x: ours faster; TTFT: ours /
llama.cpp, < 1x: ours sooner), median and range, beside the issue's targets: single-stream
decode >= 1.2x with gguf, >= 1.0x with int4 and >= 0.7x with int8, TTFT long <= 0.7x with
gguf and <= 1.0x otherwise, concurrent throughput >= 2.5x with gguf and >= 2x with int8
(printed, never asserted). llama.cpp's OpenMP threads busy-wait at every
barrier, so when other processes compete for the cores its times swing far more than
torch's: read its ratios on a quiet machine. ``--json PATH``: every figure per round,
the medians, ratios and targets (written after each model).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)
from _real_env import (  # noqa: E402
    HFLane,
    LaneRun,
    LlamaCppBatched,
    Workload,
    agreement,
    corpus_text,
    cpu_description,
    llama_cpp_lane,
    load_hf,
    make_workload,
    model_gguf,
    percentile,
    print_table,
    ratio_cell,
    spread,
    target_cell,
)


import torch  # noqa: E402
import transformers as tf  # noqa: E402

from hybridkv.checkpoint.gguf_file import GGUFFile  # noqa: E402
from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402
from hybridkv.tokenizer import tokenizer_from_gguf  # noqa: E402

MODELS = ("gemma-3-270m", "smollm2-135m")
#: precision -> (EngineConfig.dtype, EngineConfig.quantization)
PRECISIONS = {"gguf": ("float32", "gguf"), "fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "int8"),
              "int4": ("float32", "int4")}
MODES = ("single", "concurrent")
OTHERS = ("llama", "hf")
LLAMA = "llama.cpp"
#: our pool per model (fp32 KV at most): Gemma's full workload peaks at 375 MiB; SmolLM2 (all
#: 30 layers full attention, 45 KiB/token) needs ~700 MiB for it
KV_MEMORY = {"gemma-3-270m": "512MiB", "smollm2-135m": "1GiB"}
FULL = dict(n=32, prompt_range=(32, 1500), out_range=(16, 128), single_n=4, single_prompt=(32, 512),
            single_out=128, long_prompt=1000, rounds=3, kv_memory=None)
QUICK = dict(n=4, prompt_range=(32, 200), out_range=(4, 8), single_n=2, single_prompt=(32, 64),
             single_out=8, long_prompt=128, rounds=1, kv_memory="128MiB")  # a small pool: quicker to build
#: (mode, figure) -> precision -> (comparison, ratio against llama.cpp): the issue's targets
TARGETS = {
    ("single", "decode_tok_s"): {"gguf": (">=", 1.2), "int4": (">=", 1.0), "int8": (">=", 0.7)},
    ("single", "ttft_long_s"): {p: ("<=", 0.7 if p == "gguf" else 1.0) for p in PRECISIONS},
    ("concurrent", "tok_s"): {"gguf": (">=", 2.5), "int8": (">=", 2.0)},
}


# ------------------------------------------------------------------ lanes
class OursLane:
    """hybridkv at one precision: the model loaded once; :meth:`reset` builds a fresh engine."""

    def __init__(self, path: str, precision: str, kv_memory: str) -> None:
        dtype, quant = PRECISIONS[precision]
        self.model = load_model(path, dtype=dtype, quantization=quant)
        self.config = EngineConfig(block_size=16, max_model_len=2048, max_num_seqs=64, kv_cache_memory=kv_memory,
                                   dtype=dtype, quantization=quant)
        self.engine: LLMEngine | None = None

    def reset(self) -> None:
        self.engine = None  # the last one's KV pool freed first
        self.engine = LLMEngine(self.model, self.config)

    def run(self, w: Workload) -> LaneRun:
        return run_ours(self.engine, w)

    def release(self) -> None:
        """Free the engine (its KV pool) once a pass is measured: lanes that wait hold only weights."""
        self.engine = None


def run_ours(engine: LLMEngine, w: Workload) -> LaneRun:
    """All requests at once, then ``step()`` to the end; a request's first token is stamped
    by the engine at the end of the step that sampled it (``RequestOutput.first_token_time``)."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(w.prompts, w.max_tokens)]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    total = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    if any(o.num_cached_tokens or o.num_preemptions for o in outs):
        raise SystemExit("bench_real: prefix cache hits or preemptions in our lane; the comparison would be unfair")
    return LaneRun([list(o.output_token_ids) for o in outs], [o.first_token_time - t0 for o in outs], total)


# ------------------------------------------------------------------ workloads and passes
def workloads(path: str, size: dict) -> dict:
    """The model's seeded workloads: ``concurrent``, ``single`` and the ``long`` prompt."""
    tok = tokenizer_from_gguf(GGUFFile.open(path).metadata)  # hybridkv's, id for id transformers'
    ids, bos = tok.encode(corpus_text(), add_special_tokens=False), tok.bos_token_id
    return {
        "concurrent": make_workload(ids, bos, size["n"], size["prompt_range"], size["out_range"]),
        "single": make_workload(ids, bos, size["single_n"], size["single_prompt"], (size["single_out"],) * 2, seed=1),
        "long": make_workload(ids, bos, 1, (size["long_prompt"],) * 2, (1, 1), seed=2).prompts[0],
    }


def single_pass(lane, w: Workload, long_prompt: list[int]) -> dict:
    """The requests one at a time through one fresh engine / context, then the long prompt."""
    lane.reset()
    gc.collect()
    runs = [lane.run(Workload([p], [m])) for p, m in zip(w.prompts, w.max_tokens)]
    long = lane.run(Workload([long_prompt], [1]))
    release(lane)
    decode = [r.total - r.ttft[0] for r in runs]
    return {"decode_tok_s": sum(len(r.tokens[0]) - 1 for r in runs) / sum(decode),
            "ttft_p50_s": percentile([r.ttft[0] for r in runs], 0.5), "ttft_long_s": long.ttft[0],
            "ttft_s": [r.ttft[0] for r in runs], "decode_s": decode, "tokens": [r.tokens[0] for r in runs]}


def release(lane) -> None:
    """After a pass: the lane frees what only a running pass needs."""
    getattr(lane, "release", lambda: None)()
    gc.collect()


def concurrent_pass(lane, w: Workload) -> dict:
    lane.reset()
    gc.collect()
    r = lane.run(w)
    kv = lane.engine.kv_summary() if isinstance(lane, OursLane) else None
    release(lane)
    out = {"tok_s": w.output_tokens / r.total, "total_s": r.total, "ttft_mean_s": statistics.fmean(r.ttft),
           "ttft_p50_s": percentile(r.ttft, 0.5), "ttft_p99_s": percentile(r.ttft, 0.99), "tokens": r.tokens}
    if kv is not None:
        out["kv_peak_mib"] = kv.peak_bytes / 2**20
    return out


#: mode -> (figure, column title, format) in its table, the first the throughput
COLUMNS = {
    "single": [("decode_tok_s", "decode tok/s", "{:.1f}"), ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
               ("ttft_long_s", "TTFT long s", "{:.3f}")],
    "concurrent": [("tok_s", "tok/s", "{:.1f}"), ("total_s", "total s", "{:.2f}"),
                   ("ttft_mean_s", "TTFT mean s", "{:.2f}"), ("ttft_p50_s", "p50", "{:.2f}"),
                   ("ttft_p99_s", "p99", "{:.2f}")],
}
#: mode -> the figures compared with llama.cpp (those of TARGETS)
COMPARED = {"single": ("decode_tok_s", "ttft_long_s"), "concurrent": ("tok_s",)}


# ------------------------------------------------------------------ report
def summarise(mode: str, rounds: dict[str, list[dict]]) -> dict:
    """Per lane: medians over rounds and, for ours, ratios against llama.cpp round by round."""
    out = {}
    for name, rs in rounds.items():
        med = {key: statistics.median(r[key] for r in rs) for key, _, _ in COLUMNS[mode]}
        lane = {"median": med, "vs_llama_cpp": {}, "targets": {}}
        ref = rounds.get(LLAMA)
        for key in COMPARED[mode] if name.startswith("ours-") else ():
            ratios = None if ref is None else [r[key] / x[key] for r, x in zip(rs, ref)]
            ratio = lane["vs_llama_cpp"][key] = None if ratios is None else spread(ratios)
            target = TARGETS[(mode, key)].get(name.removeprefix("ours-"))
            if target:
                lane["targets"][key] = {"op": target[0], "ratio": target[1], "cell": target_cell(target, ratio)}
        out[name] = lane
    return out


def print_mode(model: str, mode: str, w: Workload, summary: dict, n_rounds: int, long_len: int) -> None:
    lens = sorted(map(len, w.prompts))
    what = (f"{len(lens)} requests one at a time, prompts {lens[0]}-{lens[-1]} tokens, {w.max_tokens[0]} new each; "
            f"TTFT long: one {long_len}-token prompt" if mode == "single" else
            f"{len(lens)} requests at once, prompts {lens[0]}-{lens[-1]} tokens (total {w.prompt_tokens}), outputs "
            f"{min(w.max_tokens)}-{max(w.max_tokens)} (total {w.output_tokens})")
    print(f"\n{model}, {mode}: {what}; medians of {n_rounds} round(s)")
    header = ["lane"] + [t for _, t, _ in COLUMNS[mode]]
    for key in COMPARED[mode]:
        title = dict((k, t) for k, t, _ in COLUMNS[mode])[key]
        header += [f"{title} vs {LLAMA}", "target"]
    rows = []
    for name, lane in summary.items():
        row = [name] + [f.format(lane["median"][k]) for k, _, f in COLUMNS[mode]]
        for key in COMPARED[mode]:
            ratio = ratio_cell(lane["vs_llama_cpp"][key]) if key in lane["vs_llama_cpp"] else ""
            row += [ratio, lane["targets"].get(key, {}).get("cell", "")]
        rows.append(row)
    print_table(header, rows)


def print_agreement(mode: str, rounds: dict[str, list[dict]]) -> dict:
    """Every lane's round-0 tokens against the first ours lane's (quantized weights and llama.cpp may differ)."""
    names = list(rounds)
    base = next((x for x in names if x.startswith("ours-")), names[0])
    out = {}
    for name in names:
        if name != base:
            a = out[name] = agreement(rounds[base][0]["tokens"], rounds[name][0]["tokens"])
            print(f"  {mode}: {base} == {name}: {a['equal']}/{a['sequences']} sequences equal; "
                  f"{a['tokens_before_divergence']}/{a['tokens']} tokens before the first divergence")
    return out


# ------------------------------------------------------------------ profile
def profile_ours(lane: OursLane, w: Workload, top: int = 18) -> None:
    """Where our lane's time goes: one run under cProfile (cumulative seconds of the engine's
    phases; cProfile slows Python-heavy code, so read shares, not absolutes), then one under
    ``torch.profiler`` (self CPU time per aten op)."""
    import cProfile
    import pstats

    from hybridkv.engine import kv_storage, model_runner, sampling
    from hybridkv.engine.attention import cpu_stack, layer, metadata
    from hybridkv.engine.models import base
    from hybridkv.engine.layers import linear, norms, quantized_linear as quantize
    from hybridkv.scheduler.scheduler import Scheduler

    phases = {
        "scheduler: schedule()": Scheduler.schedule,
        "scheduler: update_from_output()": Scheduler.update_from_output,
        "runner.execute (model + sampling)": model_runner.PagedModelRunner.execute,
        "  AttentionMetadata.build": metadata.AttentionMetadata.build,
        "  fused decode step (C, all layers)": cpu_stack.FusedDecode.run,
        "  model forward (all layers)": base.CausalLM.forward,
        "    linears (q/k/v/o, MLP GEMMs)": linear.linear,
        "      int8 weights (inside linears)": quantize.Int8Weight.linear,
        "      int4 weights (inside linears)": quantize.Int4Weight.linear,
        "    paged_attention (write+gather+attend)": layer.paged_attention,
        "      KV write": kv_storage.PagedKVStorage.write,
        "      KV gather": kv_storage.PagedKVStorage.gather,
        "    RMSNorm (C rows)": norms.RMSNorm.forward_cpu_kernels,
        "    RMSNorm (torch)": norms.RMSNorm.forward_native,
        "  compute_logits (output projection)": type(lane.model).compute_logits,
        "  sampler": sampling.Sampler.sample_rows,
    }
    lane.reset()
    prof = cProfile.Profile()
    prof.enable()
    run = lane.run(w)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    print(f"\nprofile (cProfile), one run: {run.total:.2f} s wall, {w.output_tokens} tokens")
    for label, fn in phases.items():
        code = fn.__code__
        cc, nc, tt, ct, _ = stats.get((code.co_filename, code.co_firstlineno, code.co_name), (0, 0, 0.0, 0.0, None))
        print(f"  {label:<42} {ct:>7.2f} s  {100 * ct / run.total:>5.1f} %  ({nc} calls)")
    lane.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        run = lane.run(w)
    print(f"\nprofile (torch.profiler), one run: {run.total:.2f} s wall; top aten ops by self CPU time")
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40))


# ------------------------------------------------------------------ main
def build_lanes(model: str, path: str, args, size: dict, wl: dict, llama_cpp) -> dict[str, dict]:
    """mode -> lane name -> lane: ours shared by both modes; llama.cpp a context per mode; HF one model."""
    ours = {f"ours-{p}": OursLane(path, p, size["kv_memory"] or KV_MEMORY[model]) for p in args.precisions}
    lanes = {m: dict(ours) for m in args.modes}
    if "llama" in args.lanes:
        single = max([len(p) + m for p, m in zip(wl["single"].prompts, wl["single"].max_tokens)]
                     + [len(wl["long"]) + 1])
        longest = max(len(p) + m for p, m in zip(wl["concurrent"].prompts, wl["concurrent"].max_tokens))
        shape = {"single": (1, single), "concurrent": (len(wl["concurrent"].prompts), longest)}
        for m in args.modes:
            lanes[m][LLAMA] = LlamaCppBatched(llama_cpp, path, *shape[m], args.threads, swa_full=args.llama_swa_full)
    if "hf" in args.lanes:
        hf = load_hf(path)
        for m in args.modes:
            lanes[m]["hf"] = HFLane(hf, 1 if m == "single" else args.hf_batch)
    return lanes


def warm_up(lanes: dict[str, dict], wl: dict) -> None:
    """Per lane and mode, prompts of 48 tokens (a prefill past the quantized kernels' 32 rows)
    and 3 new tokens: one prompt (single), up to 4 at once (concurrent: batched decode shapes)."""
    text = wl["concurrent"].prompts[0] + wl["long"]
    for mode, by_name in lanes.items():
        n = 1 if mode == "single" else min(4, len(wl["concurrent"].prompts))
        for lane in by_name.values():
            lane.reset()
            lane.run(Workload([text[8 * i : 8 * i + 48] for i in range(n)], [3] * n))
            release(lane)


def bench_model(model: str, args, size: dict, llama_cpp) -> dict:
    path = model_gguf(model)
    t = time.perf_counter()
    wl = workloads(path, size)
    lanes = build_lanes(model, path, args, size, wl, llama_cpp)
    warm_up(lanes, wl)
    print(f"\n== {model} ({Path(path).name}): loaded and warmed up in {time.perf_counter() - t:.0f} s", flush=True)
    if args.profile:
        return profile_ours(next(iter(lanes[args.modes[0]].values())), wl[args.modes[0]])
    names = list(next(iter(lanes.values())))
    rounds: dict[str, dict[str, list[dict]]] = {m: {x: [] for x in names} for m in args.modes}
    for r in range(size["rounds"]):
        order = names[r % len(names):] + names[: r % len(names)]
        for m in args.modes:
            for name in order:
                lane = lanes[m][name]
                res = single_pass(lane, wl[m], wl["long"]) if m == "single" else concurrent_pass(lane, wl[m])
                rounds[m][name].append(res)
            key = COLUMNS[m][0][0]
            cells = "  ".join(f"{x} {rounds[m][x][-1][key]:.1f}" for x in names)
            print(f"round {r} {m}: {cells} tok/s", flush=True)
    out = {"gguf": path}
    for m in args.modes:
        summary = summarise(m, rounds[m])
        print_mode(model, m, wl[m], summary, size["rounds"], len(wl["long"]))
        same = print_agreement(m, rounds[m])
        for rs in rounds[m].values():
            for res in rs:
                res.pop("tokens")
        lens = sorted(map(len, wl[m].prompts))
        out[m] = {"workload": {"requests": len(lens), "prompt_tokens": lens, "max_tokens": wl[m].max_tokens,
                               **({"long_prompt_tokens": len(wl["long"])} if m == "single" else {})},
                  "rounds": rounds[m], "summary": summary, "agreement": same}
    for by_name in lanes.values():
        for lane in by_name.values():
            getattr(lane, "close", lambda: None)()
    del lanes
    gc.collect()
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke size: a few short requests, 1 round")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)} (default both)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="ours: comma list of gguf, fp32, bf16, int8, int4")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of single, concurrent (default both)")
    ap.add_argument("--lanes", default="ours,llama", help="comma list of ours, llama, hf (default ours,llama)")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (--quick 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default 2)")
    ap.add_argument("--llama-swa-full", action="store_true",
                    help="llama.cpp keeps full-size caches for sliding layers (its C API's default; off by default "
                         "here, as llama-cli and llama-server run)")
    ap.add_argument("--max-prompt", type=int, default=None, help="concurrent: longest prompt (1500; --quick 200)")
    ap.add_argument("--max-output", type=int, default=None, help="concurrent: most new tokens (default 128; --quick 8)")
    ap.add_argument("--single-requests", type=int, default=None, help="single-stream requests (default 4; --quick 2)")
    ap.add_argument("--single-output", type=int, default=None, help="single-stream new tokens each (default 128)")
    ap.add_argument("--long-prompt", type=int, default=None, help="the TTFT prompt's tokens (1000; --quick 128)")
    ap.add_argument("--hf-batch", type=int, default=32, help="requests per HF batched generate (default 32: one batch)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure to PATH")
    ap.add_argument("--profile", action="store_true", help="profile our first lane (cProfile, torch.profiler) instead")
    args = ap.parse_args(argv)
    for key, known in (("models", MODELS), ("precisions", PRECISIONS), ("modes", MODES), ("lanes", ("ours",) + OTHERS)):
        setattr(args, key, [x for x in getattr(args, key).split(",") if x])
        if not getattr(args, key) or any(x not in known for x in getattr(args, key)):
            ap.error(f"--{key} must name some of {', '.join(known)}")
    if "ours" not in args.lanes:
        ap.error("--lanes must include ours")
    if args.profile:
        args.lanes = ["ours"]
    size = dict(QUICK if args.quick else FULL)
    for flag, key in (("rounds", "rounds"), ("single_requests", "single_n"), ("single_output", "single_out"),
                      ("long_prompt", "long_prompt")):
        size[key] = getattr(args, flag) or size[key]
    lo_p, hi_p = size["prompt_range"]
    lo_o, hi_o = size["out_range"]
    size["prompt_range"] = (min(lo_p, args.max_prompt or hi_p), args.max_prompt or hi_p)
    size["out_range"] = (min(lo_o, args.max_output or hi_o), args.max_output or hi_o)
    if min(args.hf_batch, args.threads, size["rounds"], size["single_n"], size["out_range"][0]) < 1 \
            or min(size["prompt_range"][0], size["long_prompt"], size["single_out"]) < 2:
        ap.error("--hf-batch, --threads, --rounds, --single-requests, --max-output >= 1; "
                 "--max-prompt, --long-prompt, --single-output >= 2")
    return args, size


def main(argv: list[str] | None = None) -> None:
    args, size = parse_args(argv)
    torch.set_num_threads(args.threads)
    llama_cpp = llama_cpp_lane(args.lanes, wanted=not args.profile)
    cpu = cpu_description()
    print(f"CPU {cpu['model']} (ISA level {cpu['isa']}, quantized compute {cpu['quantized_compute']}), "
          f"{args.threads} threads (torch and llama.cpp), torch {torch.__version__}, transformers {tf.__version__}"
          + (f", llama-cpp-python {llama_cpp.__version__}" if llama_cpp else "")
          + f"; llama.cpp swa_full {'on' if args.llama_swa_full else 'off'}; greedy, EOS ignored")
    report = {"meta": {"cpu": cpu, "llama_swa_full": args.llama_swa_full,
                       "threads": args.threads, "torch": torch.__version__, "transformers": tf.__version__,
                       "llama_cpp_python": getattr(llama_cpp, "__version__", None), "size": size,
                       "lanes": args.lanes, "precisions": args.precisions, "modes": args.modes,
                       "targets": {f"{m} {k}": v for (m, k), v in TARGETS.items()}},
              "models": {}}
    for model in args.models:
        report["models"][model] = bench_model(model, args, size, llama_cpp)
        if args.json and not args.profile:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.json and not args.profile:
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
