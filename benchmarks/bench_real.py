"""Speed on a real model: hybridkv's engine vs transformers and llama.cpp, Gemma 3 270M, 32 concurrent requests.

    PYTHONPATH=src python3 benchmarks/bench_real.py [--quick] [--rounds N] [--threads N] [--lanes a,b,...]
                                                    [--max-prompt N] [--max-output N] [--hf-batch N] [--profile]
    PYTHONPATH=src /work/.venv-llamacpp/bin/python benchmarks/bench_real.py      # with the llama.cpp lanes

llama.cpp is a benchmark-only environment (``llama-cpp-python`` built from source; never a
dependency, never in CI); its set-up is in ``benchmarks/_real_env.py`` and is printed when
the bindings are absent, in which case the llama.cpp lanes are skipped.

Workload (seeded): 32 requests that all arrive at once, prompts of 32..1,500 tokens
(log-uniform: many short, a few long, several past Gemma's 512-token window), each a
slice of the tokenized docstrings of the Python standard library at a random offset,
BOS first; outputs of 16..128 tokens, greedy, EOS ignored, so every lane generates
exactly the same number of tokens per request (2 rounds). ``--max-prompt`` /
``--max-output`` shrink the lengths (a lighter run on a busy machine); ``--quick``: 4
requests of 32..200 prompt tokens, 4..8 outputs, 1 round (a smoke run). ``--profile``:
our lane only, once under cProfile (the engine's phases) and once under torch.profiler
(aten ops), instead of the rounds.

Lanes (all in this process, ``--threads`` for torch and llama.cpp alike, default 2):

* ``ours``: ``LLMEngine`` on the GGUF (hybridkv dequantizes it to fp32), all requests
  added, then ``step()`` until done: continuous batching, chunked prefill (2,048 tokens
  per step), a 512 MiB KV pool, prefix caching on (the prompts share nothing; a hit or a
  preemption aborts the run). A fresh engine per round, built before the clock starts.
* ``hf-batch``: transformers ``generate`` (fp32 from the same GGUF, ``sdpa``), the
  requests left-padded into batches of ``--hf-batch`` (default 32: one batch) in arrival
  order; a batch generates its longest output count for every row (HF has no per-row
  length), the extra tokens are dropped.
* ``hf-single``: the same model, one unpadded ``generate`` per request, in order.
* ``llama-batch``: llama.cpp's continuous batching through its C API (one context, a
  KV sequence per request, 2,048-token batches; see ``_real_env.LlamaCppBatched``).
* ``llama-single``: ``llama_cpp.Llama.generate`` per request, in order.

hybridkv and transformers compute in fp32 on weights dequantized from Q4_K_M (the same
numbers); llama.cpp computes on the quantized weights with its own kernels (Q4_K/Q6_K
dot products, f16 KV), about 7x fewer weight bytes per token: its tokens are compared
but not required to agree. Time to first token counts from the lane's start (every
request arrives then), so a sequential lane's late requests wait for the earlier ones.
llama.cpp's OpenMP threads busy-wait at every barrier, so when other processes compete
for the cores its times swing far more than torch's (seen on 2 shared cores: the same
sequential lane 29.6 s in one round, 529 s in the next): read its ratios per round, on
a quiet machine. Lanes run in an order rotated round by round; per round and lane the ratio of its total
time to ours (= our tokens/s over its tokens/s), and the median over rounds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _real_env import (  # noqa: E402
    LaneRun,
    LlamaCppBatched,
    LlamaCppSequential,
    Workload,
    corpus_text,
    gemma_gguf,
    import_llama_cpp,
    make_workload,
    use_repo_src,
)

use_repo_src()

import torch  # noqa: E402
import transformers as tf  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from hybridkv.checkpoint.gguf_file import GGUFFile  # noqa: E402
from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402
from hybridkv.tokenizer import tokenizer_from_gguf  # noqa: E402

KV_MEMORY = "512MiB"  # our pool (fp32 KV): the full workload peaks at 375 MiB, so no preemption
LANES = ("ours", "hf-batch", "hf-single", "llama-batch", "llama-single")
FULL = dict(n=32, prompt_range=(32, 1500), out_range=(16, 128), rounds=2)
QUICK = dict(n=4, prompt_range=(32, 200), out_range=(4, 8), rounds=1)


# ------------------------------------------------------------------ ours
def ours_engine(model) -> LLMEngine:
    """A fresh engine (empty prefix cache) over the loaded model; built outside the timed region."""
    return LLMEngine(model, EngineConfig(block_size=16, max_model_len=2048, max_num_seqs=64, kv_cache_memory=KV_MEMORY))


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


# ------------------------------------------------------------------ transformers
class _FirstToken(BaseStreamer):
    """Stamps the moment ``generate`` hands out its first new tokens (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """One ``generate`` of ``prompts`` left-padded (pad id 0, attention_mask); (new tokens, first-token time)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L]
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    streamer = _FirstToken()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, streamer=streamer)
    return out[:, width:].tolist(), streamer.at


def run_hf(model, w: Workload, batch: int) -> LaneRun:
    """Requests in arrival order, ``batch`` per ``generate`` (1: one at a time, unpadded)."""
    tokens: list[list[int]] = []
    ttft: list[float] = []
    t0 = time.perf_counter()
    for s in range(0, len(w.prompts), batch):
        limits = w.max_tokens[s : s + batch]
        out, first = hf_generate(model, w.prompts[s : s + batch], max(limits))
        tokens += [row[:m] for row, m in zip(out, limits)]
        ttft += [first - t0] * len(limits)
    return LaneRun(tokens, ttft, time.perf_counter() - t0)


def load_hf(path: str):
    p = Path(path)
    model = tf.AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model.generation_config.eos_token_id = None  # never stop early (as ignore_eos)
    model.generation_config.pad_token_id = 0
    for k in ("top_k", "top_p", "temperature"):  # greedy: no sampling knobs to warn about
        setattr(model.generation_config, k, None)
    return model


def tokenize_corpus(path: str) -> tuple[list[int], int | None]:
    """The corpus through the GGUF's own tokenizer (hybridkv's, id for id transformers')."""
    tok = tokenizer_from_gguf(GGUFFile.open(path).metadata)
    return tok.encode(corpus_text(), add_special_tokens=False), tok.bos_token_id


# ------------------------------------------------------------------ profile
def profile_ours(model, w: Workload, top: int = 18) -> None:
    """Where our lane's time goes: one run under cProfile (cumulative seconds of the engine's
    phases; cProfile slows Python-heavy code, so read shares, not absolutes), then one under
    ``torch.profiler`` (self CPU time per aten op)."""
    import cProfile
    import pstats

    from hybridkv.engine import attention, kv_storage, model_runner, sampling
    from hybridkv.engine.models import base, linear
    from hybridkv.scheduler.scheduler import Scheduler

    phases = {
        "scheduler: schedule()": Scheduler.schedule,
        "scheduler: update_from_output()": Scheduler.update_from_output,
        "runner.execute (model + sampling)": model_runner.PagedModelRunner.execute,
        "  AttentionMetadata.build": attention.AttentionMetadata.build,
        "  model forward (all layers)": base.CausalLM.forward,
        "    linears (q/k/v/o, MLP GEMMs)": linear.linear,
        "    paged_attention (write+gather+attend)": attention.paged_attention,
        "      KV write": kv_storage.PagedKVStorage.write,
        "      KV gather": kv_storage.PagedKVStorage.gather,
        "      attend: manual (decode)": attention._attend_manual,
        "      attend: sdpa (prefill)": attention._attend_sdpa,
        "    RMSNorm": base.RMSNorm.forward,
        "  compute_logits (lm_head 640x262144)": type(model).compute_logits,
        "  sampler (argmax over 262144)": sampling.Sampler.sample_rows,
    }
    engine = ours_engine(model)
    prof = cProfile.Profile()
    prof.enable()
    run = run_ours(engine, w)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    print(f"\nprofile of ours (cProfile), one run: {run.total:.2f} s wall, {w.output_tokens} tokens")
    for label, fn in phases.items():
        code = fn.__code__
        cc, nc, tt, ct, _ = stats.get((code.co_filename, code.co_firstlineno, code.co_name), (0, 0, 0.0, 0.0, None))
        print(f"  {label:<42} {ct:>7.2f} s  {100 * ct / run.total:>5.1f} %  ({nc} calls)")

    engine = ours_engine(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        run = run_ours(engine, w)
    print(f"\nprofile of ours (torch.profiler), one run: {run.total:.2f} s wall; top aten ops by self CPU time")
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40))


# ------------------------------------------------------------------ report
def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    x = (len(s) - 1) * q
    lo = int(x)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (x - lo)


def agreement(name: str, mine: list[list[int]], other: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(mine, other))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(mine, other))
    return (f"ours == {name}: {same}/{len(mine)} sequences equal; "
            f"{prefix}/{sum(map(len, mine))} tokens before the first divergence")


def report(runs: dict[str, list[LaneRun]], w: Workload) -> None:
    gen = w.output_tokens
    ours = runs["ours"]
    print(f"\n{'lane':<13} {'total s':>8} {'tok/s':>7} {'TTFT mean':>10} {'p50':>7} {'p99':>7}"
          f"   {'ours/lane tok/s':>22}   {'lane/ours TTFT mean':>22}")
    for name, rs in runs.items():
        tot = statistics.median(r.total for r in rs)
        mean = statistics.median(statistics.fmean(r.ttft) for r in rs)
        p50 = statistics.median(percentile(r.ttft, 0.5) for r in rs)
        p99 = statistics.median(percentile(r.ttft, 0.99) for r in rs)
        speed = [r.total / o.total for r, o in zip(rs, ours)]
        first = [statistics.fmean(r.ttft) / statistics.fmean(o.ttft) for r, o in zip(rs, ours)]
        cells = "" if name == "ours" else (
            f"   {statistics.median(speed):>6.2f}x ({min(speed):.2f}-{max(speed):.2f}x)"
            f"   {statistics.median(first):>6.2f}x ({min(first):.2f}-{max(first):.2f}x)")
        print(f"{name:<13} {tot:>8.2f} {gen / tot:>7.1f} {mean:>10.2f} {p50:>7.2f} {p99:>7.2f}{cells}")
    print(f"(medians over {len(ours)} round(s); ratios per round, median and range; >1x: ours is faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke size: 4 short requests, 4-8 new tokens, 1 round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default 2)")
    ap.add_argument("--lanes", default=",".join(LANES), help=f"comma list of {', '.join(LANES)} (default all)")
    ap.add_argument("--max-prompt", type=int, default=None, help="longest prompt (default 1500; --quick 200)")
    ap.add_argument("--max-output", type=int, default=None, help="most new tokens (default 128; --quick 8)")
    ap.add_argument("--profile", action="store_true", help="profile our lane (cProfile, torch.profiler) instead of timing")
    ap.add_argument("--hf-batch", type=int, default=32, help="requests per HF batched generate (default 32: one batch)")
    args = ap.parse_args()
    lanes = ["ours"] if args.profile else [x for x in args.lanes.split(",") if x]
    if "ours" not in lanes or any(x not in LANES for x in lanes) or min(args.hf_batch, args.threads, args.max_prompt or 2, args.max_output or 1) < 1 \
            or (args.max_prompt or 2) < 2:
        raise SystemExit(f"bench_real: --lanes must include ours and name only {', '.join(LANES)}; "
                         "--hf-batch, --threads, --max-output >= 1, --max-prompt >= 2")
    size = dict(QUICK if args.quick else FULL)
    lo_p, hi_p = size["prompt_range"]
    lo_o, hi_o = size["out_range"]
    size["prompt_range"] = (min(lo_p, args.max_prompt or hi_p), args.max_prompt or hi_p)
    size["out_range"] = (min(lo_o, args.max_output or hi_o), args.max_output or hi_o)
    rounds = args.rounds or size["rounds"]
    torch.set_num_threads(args.threads)
    path = gemma_gguf()
    llama_cpp, why = import_llama_cpp() if any(x.startswith("llama") for x in lanes) else (None, "")
    if llama_cpp is None and why:
        print(why)
        lanes = [x for x in lanes if not x.startswith("llama")]

    t = time.perf_counter()
    corpus_ids, bos = tokenize_corpus(path)
    w = make_workload(corpus_ids, bos, size["n"], size["prompt_range"], size["out_range"])
    hf_model = load_hf(path) if any(x.startswith("hf") for x in lanes) else None
    ours_model = load_model(path)
    llama = {}
    if "llama-batch" in lanes:
        llama["llama-batch"] = LlamaCppBatched(llama_cpp, path, w, args.threads)
    if "llama-single" in lanes:
        llama["llama-single"] = LlamaCppSequential(llama_cpp, path, args.threads)
    print(f"loaded in {time.perf_counter() - t:.0f} s")

    lens = sorted(map(len, w.prompts))
    print(f"Gemma 3 270M ({Path(path).name}), CPU, {args.threads} threads (torch and llama.cpp), "
          f"torch {torch.__version__}, transformers {tf.__version__}"
          + (f", llama-cpp-python {llama_cpp.__version__}" if llama_cpp else ""))
    print(f"{len(w.prompts)} requests at once: prompts {lens[0]}-{lens[-1]} tokens (median {lens[len(lens) // 2]}, "
          f"total {w.prompt_tokens}), outputs {min(w.max_tokens)}-{max(w.max_tokens)} (total {w.output_tokens}), "
          "greedy, EOS ignored")
    print("ours and HF: fp32 weights dequantized from Q4_K_M; llama.cpp: the quantized weights themselves "
          f"(Q4_K/Q6_K kernels, f16 KV); HF batch {min(args.hf_batch, len(w.prompts))} left-padded per generate")

    kv: list = []  # our engine's KV summary after its first timed run

    def run(name: str) -> LaneRun:
        if name == "ours":
            engine = ours_engine(ours_model)
            gc.collect()
            result = run_ours(engine, w)
            kv.append(engine.kv_summary())
            return result
        gc.collect()
        if name.startswith("hf"):
            return run_hf(hf_model, w, args.hf_batch if name == "hf-batch" else 1)
        return llama[name].run(w)

    warm = Workload([p[:24] for p in w.prompts[:2]], [2, 2])  # first-call costs out of the rounds
    run_ours(ours_engine(ours_model), warm)
    for name in lanes:
        if name != "ours":
            run_hf(hf_model, warm, 2) if name.startswith("hf") else llama[name].run(warm)

    if args.profile:
        return profile_ours(ours_model, w)
    runs: dict[str, list[LaneRun]] = {x: [] for x in lanes}
    for r in range(rounds):
        for name in lanes[r % len(lanes):] + lanes[: r % len(lanes)]:
            runs[name].append(run(name))
            print(f"  {name}: {runs[name][-1].total:.1f} s", flush=True)
        print(f"round {r}: " + "  ".join(f"{x} {w.output_tokens / runs[x][-1].total:.1f} tok/s" for x in lanes),
              flush=True)
    report(runs, w)
    print(f"ours: KV peak {kv[0].peak_bytes / 2**20:.0f} MiB (fp32, hybrid layout) in a {KV_MEMORY} pool, "
          f"{kv[0].num_preemptions} preemptions, {kv[0].prefix_hit_tokens} prefix-hit tokens")
    ours = runs["ours"][0].tokens
    print()
    for name in lanes:
        if name != "ours":
            print(agreement(name, ours, runs[name][0].tokens))
    for lane in llama.values():
        lane.close()


if __name__ == "__main__":
    main()
