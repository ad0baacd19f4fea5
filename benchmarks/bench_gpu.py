"""The engine on one GPU: decode speed, capacity, long prefill and greedy parity in one run.

    PYTHONPATH=src python3 benchmarks/bench_gpu.py --out DIR [--sections a,b,c,d] [--backends reference,triton]
                                                   [--budget-s 280] [--quick] [--smoke]

Random-weight models of real shapes (Gemma-3-1B: 26 layers, 22 sliding 512; Llama-3.2-1B:
16 full layers) are built with transformers on the GPU, saved in bf16 and loaded by
``LLMEngine``; nothing is downloaded. Engine variants: ``reference`` (torch attention,
eager), ``triton`` (``attention_backend="triton"``, eager) and ``triton+graphs`` (CUDA
graphs for pure-decode steps, ``enforce_eager=False``). Sections:

a  decode: batch 1/16/64, 512-token random prompts, 128 new tokens (``ignore_eos``). The
   engine is stepped by hand: the decode phase starts (``cuda.synchronize``) at the step in
   which the last request got its first token; ms/step = decode time / decode steps, out
   tok/s = all new tokens / (prefill + decode). Each timed run follows an untimed run of
   the same shape (4 tokens: Triton compiles, graph capture). Beside it: transformers'
   ``generate`` (same prompts, greedy, min = max new tokens; its decode step = (t(128) -
   t(1)) / 127) and the weight-read floor (median time to sum every weight byte once).
b  capacity: 24 prompts of 8,192 tokens + 32 out in a 1 GiB KV pool, budget 2,048, no
   prefix caching, Gemma shape: hybrid vs all-full layout (wall time, steps, peak running).
c  prefill: one 32,000-token prompt in chunks of 8,192 on the Gemma shape (tok/s, peak memory).
d  parity: tiny random fp32 models (Gemma 3 sliding, Llama 4 chunked-local, Llama full,
   Qwen3-Next Gated DeltaNet): requests whose greedy tokens equal transformers' ``generate``.

Variants run fastest first (transformers after the first), so a tight budget drops the
slow baselines. Targets are printed beside the figures, never asserted. Every row and section catches its
own error (recorded in the JSON); ``--budget-s`` skips what no longer fits, keeping time for
the later sections. DIR/bench_gpu.json and DIR/bench_gpu.md are rewritten after every row.
``--smoke``: every section on CPU with tiny shapes in seconds (reference backend; triton too,
eager, when ``TRITON_INTERPRET=1``), for tests/test_bench_gpu_smoke.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
SECTIONS = ("a", "b", "c", "d")
#: seconds kept back for each later section when a row decides whether it still fits
RESERVE_S = {"a": 0.0, "b": 45.0, "c": 15.0, "d": 25.0}


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.2f} {unit}"
        n /= 1024
    return ""


# ----------------------------------------------------------------------------- set-up
@dataclass(frozen=True)
class Sizes:
    device: str
    dtype: str
    tiny: bool  # tiny model shapes (smoke)
    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 512
    new_tokens: int = 128
    decode_kv: str | None = "4GiB"
    cap_prompts: int = 24
    cap_prompt_len: int = 8192
    cap_out: int = 32
    cap_memory: str = "1GiB"
    cap_budget: int = 2048
    long_prompt: int = 32_000
    long_chunk: int = 8192
    long_max_len: int = 32_768
    par_prompts: int = 8
    par_new: int = 12
    floor_reps: int = 10


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.smoke:
        return Sizes("cpu", "float32", True, batches=(1, 3), prompt_len=24, new_tokens=5, decode_kv=None,
                     cap_prompts=6, cap_prompt_len=160, cap_out=3, cap_memory="240KiB", cap_budget=64,
                     long_prompt=600, long_chunk=256, long_max_len=1024, par_prompts=3, par_new=5, floor_reps=2)
    if args.quick:
        return Sizes("cuda", "bfloat16", False, batches=(1, 64), new_tokens=64, cap_prompts=12,
                     long_prompt=16_000, par_prompts=4)
    return Sizes("cuda", "bfloat16", False)


@dataclass(frozen=True)
class Variant:
    backend: str  # "reference" or "triton"
    graphs: bool

    @property
    def name(self) -> str:
        return self.backend + ("+graphs" if self.graphs else "")


class Skip(Exception):
    """A row that cannot run here (an older engine, the time budget): recorded, not an error."""


def engine_config(v: Variant, **kw: Any) -> EngineConfig:
    """``EngineConfig(**kw)`` for variant ``v``; Skip when the tree lacks the fields it needs."""
    extra: dict[str, Any] = {}
    if "attention_backend" in FIELDS:
        extra["attention_backend"] = v.backend
    elif v.backend != "reference":
        raise Skip("EngineConfig has no attention_backend (older tree)")
    if "enforce_eager" in FIELDS:
        extra["enforce_eager"] = not v.graphs
    elif v.graphs:
        raise Skip("EngineConfig has no enforce_eager (older tree)")
    return EngineConfig(**kw, **extra)


def variants(backends: list[str], smoke: bool) -> list[Variant]:
    """The variants, fastest first: triton with graphs, triton eager, reference eager
    (smoke: triton eager only, and only under ``TRITON_INTERPRET=1``)."""
    out: list[Variant] = []
    if "triton" in backends and not smoke:
        out += [Variant("triton", True), Variant("triton", False)]
    elif "triton" in backends and os.environ.get("TRITON_INTERPRET") == "1":
        out.append(Variant("triton", False))
    return out + ([Variant("reference", False)] if "reference" in backends else [])


def fastest(vs: list[Variant]) -> list[Variant]:
    """One variant per backend (graphs where there are), for sections b and c."""
    best: dict[str, Variant] = {}
    for v in vs:
        if v.backend not in best or v.graphs:
            best[v.backend] = v
    return list(best.values())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


# ----------------------------------------------------------------------------- models
ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def gemma_1b(tiny: bool) -> tuple[Any, type]:
    n = 4 if tiny else 26
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
              sliding_window=16, query_pre_attn_scalar=16, max_position_embeddings=2048) if tiny else dict(
        vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_attention_heads=4, head_dim=256,
        sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32_768)
    cfg = tf.Gemma3TextConfig(
        **kw, num_hidden_layers=n, num_key_value_heads=1,
        layer_types=["full_attention" if (i + 1) % 6 == 0 or (tiny and i == n - 1) else "sliding_attention"
                     for i in range(n)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    )
    return cfg, tf.Gemma3ForCausalLM


def llama_1b(tiny: bool) -> tuple[Any, type]:
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=2048) if tiny else dict(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131_072)
    rope = {**ROPE_LLAMA3, "original_max_position_embeddings": 256} if tiny else dict(ROPE_LLAMA3)
    return tf.LlamaConfig(**kw, tie_word_embeddings=True, rope_parameters=rope), tf.LlamaForCausalLM


SHAPES: dict[str, Callable[[bool], tuple[Any, type]]] = {"gemma-3-1b": gemma_1b, "llama-3.2-1b": llama_1b}


def build_hf(cfg: Any, cls: type, path: Path, device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random ``cls(cfg)`` made on ``device``, cast to ``dtype``, saved under ``path`` without EOS."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)
    model = model.to(dtype).eval()
    for c in (model.config, model.generation_config):
        c.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return model


# ----------------------------------------------------------------------------- timing
def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, device: str) -> dict[str, Any]:
    """Add ``prompts`` and step to the end; prefill and decode phases timed apart (see the docstring)."""
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    preempted = engine.kv_summary().num_preemptions
    sync(device)
    t0 = time.perf_counter()
    ids = {engine.add_request(p, sp) for p in prompts}
    started: set[str] = set()
    t_decode, steps, decode_steps, peak_running, step_s = None, 0, 0, 0, []
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        deltas = engine.step_deltas()
        te = time.perf_counter()
        steps += 1
        peak_running = max(peak_running, len(engine.scheduler.running) + sum(d.finished for d in deltas))
        if t_decode is not None:
            decode_steps += 1
            step_s.append(te - ts)
            continue
        started.update(d.request_id for d in deltas if d.new_token_ids)
        if started >= ids:
            sync(device)
            t_decode = time.perf_counter()
    sync(device)
    t1 = time.perf_counter()
    t_decode = t_decode if t_decode is not None else t1
    decode_s = t1 - t_decode
    return dict(
        wall_s=t1 - t0, prefill_s=t_decode - t0, decode_s=decode_s, steps=steps, decode_steps=decode_steps,
        out_tok_s=len(prompts) * new_tokens / (t1 - t0),
        step_ms=decode_s / decode_steps * 1e3 if decode_steps else None,
        step_ms_median=statistics.median(step_s) * 1e3 if step_s else None,
        peak_running=peak_running, preemptions=engine.kv_summary().num_preemptions - preempted,
    )


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy ``generate`` of equal-length prompts (one batch, no padding); the new tokens."""
    ids = torch.tensor(prompts, device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def time_hf(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> dict[str, Any]:
    def timed(n: int) -> float:
        sync(device)
        t = time.perf_counter()
        hf_generate(model, prompts, n)
        sync(device)
        return time.perf_counter() - t

    timed(1)  # warm-up
    t1, tn = timed(1), timed(new_tokens)
    return dict(wall_s=tn, prefill_s=t1, out_tok_s=len(prompts) * new_tokens / tn,
                step_ms=(tn - t1) / (new_tokens - 1) * 1e3 if new_tokens > 1 else None)


def time_op(fn: Callable[[], Any], device: str, inner: int = 10) -> float:
    """Seconds per call of ``fn``, ``inner`` calls back to back (CUDA events on a GPU)."""
    if not device.startswith("cuda"):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t) / inner
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / inner


def weight_floor(model: torch.nn.Module, device: str, reps: int) -> dict[str, Any]:
    """Median time to read every (unique) weight byte once: one ``sum`` over a flat copy of them."""
    params = {p.data_ptr(): p.detach() for p in model.parameters()}.values()
    nbytes = sum(p.numel() * p.element_size() for p in params)
    flat = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in params])
    flat = torch.nn.functional.pad(flat, (0, -len(flat) % 4)).view(torch.float32)
    times = [time_op(lambda: flat.sum(), device) for _ in range(reps + 3)][3:]
    del flat
    free(device)
    s = statistics.median(times)
    return dict(weight_bytes=nbytes, floor_ms=s * 1e3, read_gb_s=nbytes / s / 1e9)


# ----------------------------------------------------------------------------- the report
class Report:
    """Rows per section, the error of a section, notes; written (json + md) after every change."""

    def __init__(self, out: Path, meta: dict[str, Any], sections: list[str]) -> None:
        self.out, self.meta = out, meta
        self.sections: dict[str, dict[str, Any]] = {s: {"rows": [], "error": None, "notes": []} for s in sections}
        self.meta.setdefault("notes", [])

    def row(self, section: str, case: str, variant: str, result: str, target: str = "", **data: Any) -> None:
        self.sections[section]["rows"].append(dict(case=case, variant=variant, result=result, target=target, **data))
        log(f"[{section}] {case} | {variant} | {result}" + (f" | {target}" if target else ""))
        self.write()

    def note(self, section: str, text: str) -> None:
        self.sections[section]["notes"].append(text)
        log(f"[{section}] note: {text}")

    def table(self) -> str:
        lines = ["| section | case | variant | result | target |", "|---|---|---|---|---|"]
        for s, sec in self.sections.items():
            for r in sec["rows"]:
                cells = [s, r["case"], r["variant"], r["result"], r["target"]]
                lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
            if sec["error"]:
                lines.append(f"| {s} | SECTION ERROR | | {sec['error'].splitlines()[-1][:200]} | |")
        notes = [f"- {n}" for n in self.meta["notes"]]
        notes += [f"- {s}: {n}" for s, sec in self.sections.items() for n in sec["notes"]]
        return "\n".join(lines + ([""] + notes if notes else []))

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "bench_gpu.json").write_text(json.dumps({"meta": self.meta, "sections": self.sections}, indent=1))
        (self.out / "bench_gpu.md").write_text(self.table() + "\n")


class Budget:
    def __init__(self, seconds: float, order: list[str]) -> None:
        self.deadline, self.order = time.perf_counter() + seconds, order

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def check(self, section: str, need_s: float = 0.0) -> None:
        """Skip unless ``need_s`` plus the later sections' reserves still fit."""
        later = self.order[self.order.index(section) + 1:]
        if self.left() < need_s + sum(RESERVE_S[s] for s in later):
            raise Skip(f"time budget ({self.left():.0f} s left)")


def attempt(report: Report, section: str, case: str, variant: str, fn: Callable[[], None]) -> None:
    """Run one row; a Skip or an error becomes a row of its own (the rest goes on)."""
    try:
        fn()
    except Skip as e:
        report.row(section, case, variant, f"skipped: {e}", skipped=str(e))
    except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
        report.row(section, case, variant, f"ERROR {type(e).__name__}: {e}"[:300], error=traceback.format_exc())


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


# ----------------------------------------------------------------------------- sections
@dataclass
class Ctx:
    sizes: Sizes
    variants: list[Variant]
    report: Report
    budget: Budget
    tmp: Path
    skip_hf: bool


def section_a(ctx: Ctx) -> None:
    for shape, make in SHAPES.items():
        attempt(ctx.report, "a", shape, "build", lambda s=shape, m=make: decode_shape(ctx, s, m))


def decode_shape(ctx: Ctx, shape: str, make: Callable[[bool], tuple[Any, type]]) -> None:
    """The floor, every variant at every batch, and transformers after the first variant."""
    sz, rep = ctx.sizes, ctx.report
    ctx.budget.check("a", 20)
    cfg, cls = make(sz.tiny)
    path = ctx.tmp / shape
    hf = build_hf(cfg, cls, path, sz.device, getattr(torch, sz.dtype))
    floor: dict[str, Any] = {}

    def do_floor() -> None:
        floor.update(weight_floor(hf, sz.device, sz.floor_reps))
        rep.row("a", shape, "weight-read floor", f"{human_bytes(floor['weight_bytes'])} in "
                f"{floor['floor_ms']:.3f} ms = {floor['read_gb_s']:,.0f} GB/s", **floor)

    try:
        attempt(rep, "a", shape, "weight-read floor", do_floor)
        prompts = {b: random_prompts(b, sz.prompt_len, cfg.vocab_size, seed=b) for b in sz.batches}
        hf_rows: dict[int, dict[str, Any]] = {}
        for i, v in enumerate(ctx.variants):
            attempt(rep, "a", shape, v.name, lambda v=v: decode_variant(ctx, shape, path, v, prompts, floor))
            if i == 0 and not ctx.skip_hf:  # HF after the first (fastest) variant, before the slower ones
                for b in sz.batches:
                    attempt(rep, "a", f"{shape} B={b}", "transformers",
                            lambda b=b: decode_hf(ctx, shape, hf, b, prompts[b], hf_rows))
        annotate_hf(rep, shape, hf_rows)
    finally:
        del hf
        free(sz.device)


def decode_variant(ctx: Ctx, shape: str, path: Path, v: Variant, prompts: dict[int, list[list[int]]],
                   floor: dict[str, Any]) -> None:
    sz = ctx.sizes
    ctx.budget.check("a", 10)
    cfg = engine_config(v, device=sz.device, dtype=sz.dtype, kv_cache_memory=sz.decode_kv, enable_prefix_caching=False,
                        max_model_len=sz.prompt_len + sz.new_tokens + 16, max_num_seqs=max(64, *sz.batches))
    engine = LLMEngine(path, cfg)
    try:
        for b in sz.batches:
            attempt(ctx.report, "a", f"{shape} B={b}", v.name, lambda b=b: decode_one(ctx, engine, shape, v, b,
                                                                                        prompts[b], floor))
    finally:
        del engine
        free(sz.device)


def decode_one(ctx: Ctx, engine: LLMEngine, shape: str, v: Variant, b: int, prompts: list[list[int]],
               floor: dict[str, Any]) -> None:
    sz = ctx.sizes
    ctx.budget.check("a", 5)
    run_engine(engine, prompts, min(4, sz.new_tokens), sz.device)  # warm-up: compile, capture
    r = run_engine(engine, prompts, sz.new_tokens, sz.device)
    text = f"{r['out_tok_s']:,.1f} tok/s; {r['step_ms']:.2f} ms/step (median {r['step_ms_median']:.2f})"
    if floor:
        r["x_floor"] = r["step_ms"] / floor["floor_ms"]
        text += f"; {r['x_floor']:.1f}x floor"
    if r["preemptions"]:
        text += f"; {r['preemptions']} preemptions"
    target = ""
    if shape.startswith("gemma") and b in (1, 64):
        limit = 2.0 if b == 1 else 3.0
        target = f"step <= {limit:g} ms: {met(r['step_ms'] <= limit)}"
    ctx.report.row("a", f"{shape} B={b}", v.name, text, target, batch=b, shape=shape, **r)


def annotate_hf(report: Report, shape: str, hf_rows: dict[int, dict[str, Any]]) -> None:
    """Each engine row of ``shape``: its speed-up over transformers (out tok/s, and decode step)."""
    for r in report.sections["a"]["rows"]:
        hf = hf_rows.get(r.get("batch", -1))
        if r.get("shape") != shape or hf is None or "out_tok_s" not in r:
            continue
        r["x_hf"] = r["out_tok_s"] / hf["out_tok_s"]
        r["result"] += f"; {r['x_hf']:.1f}x HF"
        if hf["step_ms"] and r["step_ms"]:
            r["x_hf_step"] = hf["step_ms"] / r["step_ms"]
            r["result"] += f" (step {r['x_hf_step']:.1f}x)"
        if r["batch"] == 64:
            r["target"] = "; ".join(filter(None, [r["target"], f">= 10x HF: {met(r['x_hf'] >= 10)}"]))
    report.write()


def decode_hf(ctx: Ctx, shape: str, hf: Any, b: int, prompts: list[list[int]],
              hf_rows: dict[int, dict[str, Any]]) -> None:
    sz = ctx.sizes
    ctx.budget.check("a", 20)
    r = time_hf(hf, prompts, sz.new_tokens, sz.device)
    hf_rows[b] = r
    step = f"{r['step_ms']:.2f}" if r["step_ms"] is not None else "-"
    ctx.report.row("a", f"{shape} B={b}", "transformers",
                   f"{r['out_tok_s']:,.1f} tok/s; {step} ms/step (t(n)-t(1))", batch=b, **r)


def save_gemma(ctx: Ctx) -> Path:
    """The Gemma-shaped checkpoint of sections b and c (section a's, or saved once here)."""
    sz = ctx.sizes
    path = ctx.tmp / "gemma-3-1b"
    if not (path / "config.json").exists():
        cfg, cls = gemma_1b(sz.tiny)
        build_hf(cfg, cls, path, sz.device, getattr(torch, sz.dtype))
        free(sz.device)
    return path


def section_b(ctx: Ctx) -> None:
    sz, rep = ctx.sizes, ctx.report
    path = save_gemma(ctx)
    cfg, _ = gemma_1b(sz.tiny)
    prompts = random_prompts(sz.cap_prompts, sz.cap_prompt_len, cfg.vocab_size, seed=7)
    case = f"{sz.cap_prompts} x {sz.cap_prompt_len:,}+{sz.cap_out}, KV {sz.cap_memory}"
    for v in fastest(ctx.variants):
        results: dict[bool, dict[str, Any]] = {}
        for hybrid in (True, False):
            attempt(rep, "b", case, f"{v.name} {'hybrid' if hybrid else 'all-full'}",
                    lambda h=hybrid: capacity_one(ctx, path, v, h, prompts, results))
        if len(results) == 2:
            ratio = results[True]["wall_s"] / results[False]["wall_s"]
            rep.row("b", case, f"{v.name} hybrid/all-full", f"time {ratio:.2f}x; steps "
                    f"{results[True]['steps']}/{results[False]['steps']}", f"<= 0.6x: {met(ratio <= 0.6)}", ratio=ratio)


def capacity_one(ctx: Ctx, path: Path, v: Variant, hybrid: bool, prompts: list[list[int]],
                 results: dict[bool, dict[str, Any]]) -> None:
    sz = ctx.sizes
    ctx.budget.check("b", 40 if v.backend == "reference" else 15)  # the baseline: 11-38 s a run
    cfg = engine_config(v, device=sz.device, dtype=sz.dtype, kv_cache_memory=sz.cap_memory, hybrid=hybrid,
                        max_num_batched_tokens=sz.cap_budget, enable_prefix_caching=False,
                        max_model_len=sz.cap_prompt_len + 64)
    engine = LLMEngine(path, cfg)
    try:
        run_engine(engine, [p[: sz.cap_budget + 100] for p in prompts[:2]], 2, sz.device)  # warm-up
        r = run_engine(engine, prompts, sz.cap_out, sz.device)
    finally:
        del engine
        free(sz.device)
    results[hybrid] = r
    ctx.report.row("b", f"{len(prompts)} x {sz.cap_prompt_len:,}+{sz.cap_out}, KV {sz.cap_memory}",
                   f"{v.name} {'hybrid' if hybrid else 'all-full'}",
                   f"{r['wall_s']:.2f} s; {r['steps']} steps; peak running {r['peak_running']}; "
                   f"{r['preemptions']} preemptions", hybrid=hybrid, **r)


def section_c(ctx: Ctx) -> None:
    sz = ctx.sizes
    path = save_gemma(ctx)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompt = random_prompts(1, sz.long_prompt, vocab, seed=11)
    case = f"1 x {sz.long_prompt:,} tokens, chunks of {sz.long_chunk:,}"
    for v in fastest(ctx.variants):
        attempt(ctx.report, "c", case, v.name, lambda v=v: prefill_one(ctx, path, v, prompt, case))


def prefill_one(ctx: Ctx, path: Path, v: Variant, prompt: list[list[int]], case: str) -> None:
    sz = ctx.sizes
    ctx.budget.check("c", 5)
    cfg = engine_config(v, device=sz.device, dtype=sz.dtype, max_num_batched_tokens=sz.long_chunk,
                        enable_prefix_caching=False, max_model_len=sz.long_max_len, max_num_seqs=4)
    engine = LLMEngine(path, cfg)
    try:
        run_engine(engine, [prompt[0][: sz.long_chunk + 100]], 1, sz.device)  # warm-up
        if sz.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        r = run_engine(engine, prompt, 1, sz.device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if sz.device.startswith("cuda") else None
    finally:
        del engine
        free(sz.device)
    tok_s = sz.long_prompt / r["wall_s"]
    text = f"{tok_s:,.0f} tok/s ({r['wall_s']:.3f} s, {r['steps']} steps)"
    if peak is not None:
        text += f"; peak {peak:.1f} GiB"
    ctx.report.row("c", case, v.name, text, f">= 150k tok/s: {met(tok_s >= 150_000)}", tok_s=tok_s, peak_gib=peak, **r)


def parity_models() -> dict[str, Callable[[], tuple[Any, type]]]:
    """Tiny fp32 recipes (as tests/support/hf_tiny.py and qwen3_next_tiny.py)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512)
    return {
        "gemma3 sliding": lambda: (tf.Gemma3TextConfig(
            **common, num_hidden_layers=6, head_dim=16, sliding_window=12, sliding_window_pattern=3,
            query_pre_attn_scalar=24, final_logit_softcapping=5.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
            tf.Gemma3ForCausalLM),
        "llama4 chunked": lambda: (tf.Llama4TextConfig(
            **common, num_hidden_layers=6, head_dim=16, intermediate_size_mlp=80, attention_chunk_size=20,
            moe_layers=[], floor_scale=8, attn_scale=0.5), tf.Llama4ForCausalLM),
        "llama full": lambda: (tf.LlamaConfig(**common, num_hidden_layers=4, rope_parameters={
            **ROPE_LLAMA3, "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32}),
            tf.LlamaForCausalLM),
        "qwen3-next gdn": lambda: (tf.Qwen3NextConfig(
            **common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            mlp_only_layers=[2]), tf.Qwen3NextForCausalLM),
    }


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights larger than HF's init so every path matters (zero-centred norms near 0 for Gemma / Qwen3-Next)."""
    gen = torch.Generator().manual_seed(seed)
    zero_centred = any(k in type(model).__name__.lower() for k in ("gemma", "qwen3next"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1:
                p.copy_((0.0 if zero_centred or "norm" not in name else 1.0) + 0.3 * noise)
            else:
                p.copy_(noise * (1.5 / (p.shape[-1] if p.ndim == 2 else p.shape[-2]) ** 0.5))


def section_d(ctx: Ctx) -> None:
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for name, make in parity_models().items():
            attempt(ctx.report, "d", name, "build", lambda n=name, m=make: parity_model(ctx, n, m))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def parity_model(ctx: Ctx, name: str, make: Callable[[], tuple[Any, type]]) -> None:
    sz = ctx.sizes
    ctx.budget.check("d", 3)
    cfg, cls = make()
    cfg._attn_implementation = "eager"
    path = ctx.tmp / ("parity-" + name.replace(" ", "-"))
    torch.manual_seed(0)
    with torch.device(sz.device):
        hf = cls(cfg).eval()
    redraw(hf, 0)
    for c in (hf.config, hf.generation_config):
        c.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    hf.save_pretrained(path)
    rng = random.Random(3)
    shared = [rng.randrange(128) for _ in range(16)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(128) for _ in range(rng.randrange(8, 60))]
               for i in range(sz.par_prompts)]
    want = [hf_generate(hf, [p], sz.par_new)[0] for p in prompts]
    del hf
    free(sz.device)
    for v in ctx.variants:
        attempt(ctx.report, "d", name, v.name, lambda v=v: parity_one(ctx, name, path, v, prompts, want))


def parity_one(ctx: Ctx, name: str, path: Path, v: Variant, prompts: list[list[int]], want: list[list[int]]) -> None:
    sz = ctx.sizes
    cfg = engine_config(v, device=sz.device, dtype="float32", block_size=8, max_num_batched_tokens=32)
    engine = LLMEngine(path, cfg)
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=sz.par_new, ignore_eos=True))
    finally:
        del engine
        free(sz.device)
    same = sum(list(o.output_token_ids) == w for o, w in zip(outs, want))
    ctx.report.row("d", name, v.name, f"{same}/{len(prompts)} requests equal HF greedy",
                   f"all equal: {met(same == len(prompts))}", equal=same, requests=len(prompts))


SECTION_FNS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d}


# ----------------------------------------------------------------------------- main
def meta(sizes: Sizes, vs: list[Variant]) -> dict[str, Any]:
    m: dict[str, Any] = dict(torch=torch.__version__, transformers=tf.__version__, device=sizes.device,
                             dtype=sizes.dtype, variants=[v.name for v in vs], sizes=dataclasses.asdict(sizes),
                             engine_fields=sorted(FIELDS & {"attention_backend", "enforce_eager"}))
    try:
        import triton

        m["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        m["triton"] = None
    if sizes.device.startswith("cuda") and torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name()
    return m


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="writes OUT/bench_gpu.json and OUT/bench_gpu.md")
    ap.add_argument("--sections", default="a,b,c,d", help="comma list of a (decode), b (capacity), c (prefill), d (parity)")
    ap.add_argument("--backends", default="reference,triton", help="comma list of reference, triton")
    ap.add_argument("--budget-s", type=float, default=280.0, help="skip what no longer fits after this many seconds")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 64, 64 new tokens, 12 capacity prompts, 16k prefill")
    ap.add_argument("--smoke", action="store_true", help="every section on CPU with tiny shapes (seconds)")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers generate in section a")
    args = ap.parse_args(argv)
    args.sections = [s for s in SECTIONS if s in args.sections.split(",")]
    args.backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in args.backends if b not in ("reference", "triton")]
    if bad or not args.sections:
        ap.error(f"unknown backends {bad}" if bad else "no known section in --sections")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tf.utils.logging.disable_progress_bar()
    sizes = sizes_for(args)
    if sizes.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --smoke for the CPU run")
        return 2
    vs = variants(args.backends, args.smoke)
    report = Report(args.out, {**meta(sizes, vs), "argv": sys.argv[1:] if argv is None else argv}, args.sections)
    log(f"bench_gpu: {report.meta}")
    for field in ("attention_backend", "enforce_eager"):
        if field not in FIELDS:
            report.meta["notes"].append(f"EngineConfig has no {field} (older tree): variants needing it are skipped")
            log(f"note: {report.meta['notes'][-1]}")
    budget = Budget(args.budget_s, args.sections)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        ctx = Ctx(sizes, vs, report, budget, Path(tmp), args.skip_hf)
        for s in args.sections:
            t = time.perf_counter()
            log(f"== section {s} ({budget.left():.0f} s of budget left)")
            try:
                budget.check(s)
                SECTION_FNS[s](ctx)
            except Skip as e:
                report.note(s, f"skipped: {e}")
            except Exception:  # noqa: BLE001
                report.sections[s]["error"] = traceback.format_exc()
                log(report.sections[s]["error"])
            report.sections[s]["seconds"] = round(time.perf_counter() - t, 2)
            report.write()
    log("\n" + report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
