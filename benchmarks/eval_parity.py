"""Accuracy parity of the hybrid KV layout against all-full, at each weight precision, on real
models (accuracy is measured, not assumed).

    nice -n 10 python3 benchmarks/eval_parity.py [--quick] [--models gemma-3-270m,smollm2-135m]
        [--precisions fp32,gguf,bf16,int8,int4,kv-bf16,kv-fp16,int8-kv-bf16] [--lengths 1024,2048,4096,8192] [--items-per-length N]
        [--qa-items N] [--seed S] [--kv-budget 1GiB] [--threads N] [--hf] [--json PATH]

vLLM accepted chunked local attention in its hybrid KV cache manager on an accuracy
table: long-context retrieval and a QA set, "this change" against "baseline", equal
scores. This is that table for our hybrid layout, and for each weight precision the
engine runs. The items (``_eval_data.py``) are a seeded RULER-style needle-in-a-haystack
set (single needle, multi-key, multi-value) at each ``--lengths`` bound (prompt + answer
tokens, counted with the model's own tokenizer, needle depths spread over 0-100 %) plus a
short-answer QA set; nothing is downloaded.

Models: Gemma 3 270M base (sliding window 512, every 6th layer full) on plain
completion prompts, and SmolLM2-135M-Instruct (all full attention; 8,192 positions)
through its chat template; both GGUF files from the package index, read by our loader
and tokenizer. Precisions (``--precisions``, default all): ``fp32`` (float32 weights and
KV, no quantization: the exact path and the reference), ``gguf`` (the file's quantized
blocks run as stored, fp32 activations and KV: what ``--quantization auto`` picks on a CPU), ``bf16`` (bfloat16
weights, activations and KV), ``int8`` / ``int4`` (float32 model and KV, weight-only
quantization: ``load_model(..., quantization=...)``, int8 per output channel, int4
group-wise), ``kv-bf16`` / ``kv-fp16`` (float32 model, the KV cache in bfloat16 / float16:
``--kv-cache-dtype``), ``int8-kv-bf16`` (both). Each model is loaded once per precision and that one load runs every item
greedy twice through ``LLMEngine``, all items batched in one ``generate``: with the
hybrid layout (``EngineConfig(dtype=..., quantization=...)``) and with every layer's KV
kept as full attention (the same with ``hybrid=False``), both with a KV pool of
``--kv-budget``.

``--quick`` is a smoke run: 384-token items of niah_single and niah_multikey and 2 QA
items (multivalue's 96-token answers left out), every model and precision.

Measured, per model and precision:

* accuracy per task and length in both layouts (:func:`_eval_data.score`, mean %);
* the items whose output tokens differ between hybrid and all-full (target 0 at every
  precision; each listed);
* greedy-token agreement with fp32: the fraction of items whose hybrid output tokens
  equal fp32's hybrid output exactly, and the mean over items of the matching leading
  tokens as a fraction of the longer of the two outputs (1 only for an exact match;
  two empty outputs agree) -- :func:`agreement`;
* per context length the KV bytes one request holds and the largest batch that fits
  ``--kv-budget`` in each layout, both from the planner's
  :class:`~hybridkv.planner.grouping.Grouping` of each engine (printed once per KV dtype).

A summary table per model: precision | score hybrid | score all-full | items differing
hybrid vs all-full | agreement with fp32 (items exact, mean prefix). ``--hf`` also runs
transformers' own load of the GGUF (float32) on the same token ids, one item at a time,
as a cross-check against the fp32 hybrid outputs (its accuracy and the items where it
differs). Without fp32 among ``--precisions`` no agreement is reported. ``--json`` writes
it all: per model ``precisions`` (each one's accuracy rows, ``differ``, ``agreement``, KV
rows, engine figures, or its ``error``), the ``summary`` rows, and ``items`` with the
outputs, output token ids, scores and fp32 agreement of every precision and layout.

The small models score what they score (a 270M base model is weak at 8k): the point is
that the two layouts score the same, item for item, at every precision, and how far each
precision's greedy tokens drift from fp32's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)

import _eval_data as data  # noqa: E402

#: --quick: short items and no multivalue (its 96-token answer is ~5x the decode steps of the
#: rest: with it a quick run over 2 models x 4 precisions x 2 layouts takes minutes)
QUICK = dict(lengths=[384], items_per_length=1, qa_items=2, tasks=["niah_single", "niah_multikey", "qa"])
FULL = dict(lengths=[1024, 2048, 4096, 8192], items_per_length=1, qa_items=12, tasks=list(data.TASKS))
LAYOUTS = ("hybrid", "full")
LAYOUT_NAMES = {"hybrid": "hybrid", "full": "all-full", "hf": "HF"}


@dataclass(frozen=True)
class EvalModel:
    """A model of the eval: its installed name, and whether it is prompted through its chat template."""

    name: str
    chat: bool
    label: str


MODELS = {
    "gemma-3-270m": EvalModel("gemma-3-270m", False, "Gemma 3 270M base (GGUF Q4_K_M), completion prompts"),
    "smollm2-135m": EvalModel("smollm2-135m", True, "SmolLM2-135M-Instruct (GGUF Q4_1), chat template"),
}


@dataclass(frozen=True)
class Precision:
    """A weight precision of the engine: the model / activation dtype, the weight-only quantization
    and the KV cache's dtype (``kv_cache_dtype``: "auto" is ``dtype``)."""

    name: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str = "auto"


#: in run order; fp32 (the engine's exact default) is the reference of the agreement figures
PRECISIONS = {
    "fp32": Precision("fp32", "float32", None),
    "gguf": Precision("gguf", "float32", "gguf"),
    "bf16": Precision("bf16", "bfloat16", None),
    "int8": Precision("int8", "float32", "int8"),
    "int4": Precision("int4", "float32", "int4"),
    "kv-bf16": Precision("kv-bf16", "float32", None, "bfloat16"),
    "kv-fp16": Precision("kv-fp16", "float32", None, "float16"),
    "int8-kv-bf16": Precision("int8-kv-bf16", "float32", "int8", "bfloat16"),
}
REFERENCE = "fp32"


class EngineRun(NamedTuple):
    """One engine run over all items: output ids in item order, wall seconds of the
    ``generate`` call, its KV figures, and the planner's grouping it used."""

    token_ids: list[list[int]]
    seconds: float
    extra: dict[str, Any]
    grouping: Any  # hybridkv.planner.grouping.Grouping


# ------------------------------------------------------------------ loading
def gguf_path(name: str) -> Path:
    """The installed GGUF file of a model name (Part A's resolver: an error with the pip line if absent)."""
    from hybridkv.checkpoint.installed import resolve_model

    return Path(resolve_model(name).path)


def load_tokenizer(path: Path):
    """Our tokenizer, built from the GGUF's metadata."""
    from hybridkv.checkpoint.gguf_file import GGUFFile
    from hybridkv.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(GGUFFile.open(path).metadata)


def load_precision(path: Path, precision: Precision):
    """The model of ``path`` at ``precision`` (one load, shared by both layouts)."""
    from hybridkv.engine.models import load_model

    return load_model(path, dtype=precision.dtype, quantization=precision.quantization)


def renderer(model: EvalModel, tok) -> Callable[[data.Item], str]:
    """Item -> prompt text: plain completion, or the chat template's user turn + answer prefix."""
    if model.chat:
        return data.chat_prompt(lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True))
    return data.completion_prompt


def encoder(model: EvalModel, tok) -> Callable[[str], list[int]]:
    """Prompt text -> ids as transformers feeds them: special tokens (BOS) added to a plain
    prompt, none to a chat render (its template writes them; HF's ``apply_chat_template``)."""
    return lambda text: tok.encode(text, add_special_tokens=not model.chat)


# -------------------------------------------------------------------- lanes
def run_engine(
    causal_lm, prompts: list[list[int]], items: Sequence[data.Item], hybrid: bool, args, max_len: int,
    precision: Precision = PRECISIONS[REFERENCE],
) -> EngineRun:
    """All items through one ``LLMEngine.generate`` (batched by the scheduler), greedy, on
    ``causal_lm`` loaded at ``precision`` (the config says the same dtype and quantization)."""
    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.scheduler import SamplingParams

    config = EngineConfig(
        hybrid=hybrid, max_model_len=max_len, kv_cache_memory=args.kv_budget,
        dtype=precision.dtype, quantization=precision.quantization, kv_cache_dtype=precision.kv_cache_dtype,
        kv_store=args.kv_store,
    )
    engine = LLMEngine(causal_lm, config)
    params = [SamplingParams(max_tokens=item.max_tokens) for item in items]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    summary = engine.kv_summary()
    extra = {
        "preemptions": sum(o.num_preemptions for o in outs),
        "prefix_hit_tokens": summary.prefix_hit_tokens,
        "num_blocks": engine.kv_cache_config.num_blocks,
        "peak_kv_bytes": summary.peak_bytes,
        "groups": [g.label + f" x{g.num_layers}" for g in summary.groups],
    }
    grouping = engine.grouping
    del engine
    return EngineRun([list(o.output_token_ids) for o in outs], seconds, extra, grouping)


def run_hf(path: Path, prompts: list[list[int]], items: Sequence[data.Item], eos: Sequence[int]):
    """transformers' own load of the GGUF on the same ids, one item at a time, greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out, start = [], time.perf_counter()
    with torch.inference_mode():
        for ids, item in zip(prompts, items):
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=item.max_tokens, do_sample=False,
                eos_token_id=list(eos), pad_token_id=eos[0],
            )
            out.append(y[0, len(ids):].tolist())
    seconds = time.perf_counter() - start
    del model
    return out, seconds


# ------------------------------------------------------------------ summary
def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_fraction(a: Sequence[int], b: Sequence[int]) -> float:
    """The shared leading tokens as a fraction of the longer output: 1.0 only when equal
    (two empty outputs agree), so a run that stops early or runs on is not full agreement."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else common_prefix(a, b) / longest


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Greedy-token agreement of ``outputs`` with ``reference`` (item by item): items whose
    tokens are equal, their fraction, and the mean :func:`prefix_fraction`.

    >>> agreement([[1, 2, 3], [1, 5, 6, 7], []], [[1, 2, 3], [1, 2], []])
    {'items': 3, 'exact': 2, 'exact_fraction': 0.6666666666666666, 'mean_prefix': 0.75}
    """
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    exact = sum(list(a) == list(b) for a, b in zip(outputs, reference))
    n = len(outputs)
    return {
        "items": n,
        "exact": exact,
        "exact_fraction": exact / n if n else 1.0,
        "mean_prefix": sum(prefix_fraction(a, b) for a, b in zip(outputs, reference)) / n if n else 1.0,
    }


def accuracy_rows(items: Sequence[data.Item], scores: dict[str, list[float]], outputs: dict[str, list[list[int]]]):
    """Per (task, length) and overall: items, mean score (%) per lane, items differing from hybrid."""
    keys = list(dict.fromkeys((it.task, it.length) for it in items)) + [("all", -1)]
    rows = []
    for task, length in keys:
        ix = [i for i, it in enumerate(items) if task == "all" or (it.task, it.length) == (task, length)]
        row = {"task": task, "length": length, "items": len(ix)}
        for lane, s in scores.items():
            row[lane] = 100 * sum(s[i] for i in ix) / len(ix)
            if lane != "hybrid":
                row[f"{lane}_differ"] = sum(outputs[lane][i] != outputs["hybrid"][i] for i in ix)
        rows.append(row)
    return rows


def kv_rows(groupings: dict[str, Any], lengths: Sequence[int], budget: int):
    """Per context length and layout: KV bytes one request holds (the engine's rule,
    ``blocks_per_request * bytes_per_block`` of the planner's Grouping) and the whole
    requests ``budget`` holds (the planner's ``layout_plan``)."""
    from hybridkv.engine.kv_summary import kv_bytes_per_request
    from hybridkv.planner.plan import layout_plan

    rows = []
    for length in lengths:
        row = {"length": length}
        for layout, g in groupings.items():
            row[f"{layout}_bytes"] = kv_bytes_per_request(g, length)
            row[f"{layout}_batch"] = layout_plan(layout, g, budget, length).max_num_requests
        rows.append(row)
    return rows


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per precision: overall score in each layout, items differing hybrid vs
    all-full, agreement with the reference (None without one), or the error it hit."""
    rows = []
    for name, run in report["precisions"].items():
        if "error" in run:
            rows.append({"precision": name, "error": run["error"]})
            continue
        overall = run["accuracy"][-1]
        rows.append({
            "precision": name,
            "dtype": run["dtype"],
            "quantization": run["quantization"],
            "score_hybrid": overall["hybrid"],
            "score_full": overall["full"],
            "items": len(report["items"]),
            "differ": len(run["differ"]),
            "agreement": run["agreement"],
        })
    return rows


def fmt_bytes(n: int) -> str:
    from hybridkv.planner.sizes import format_bytes

    return format_bytes(n)


def print_model(report: dict[str, Any], budget_text: str) -> None:
    runs = {k: r for k, r in report["precisions"].items() if "error" not in r}
    n = len(report["items"])
    print(f"\n== {report['model']}: {report['label']} ==")
    print(
        f"{report['num_layers']} layers; KV groups hybrid [{', '.join(report['groups']['hybrid'])}], "
        f"all-full [{', '.join(report['groups']['full'])}]; {n} items, {report['prompt_tokens']:,} prompt tokens"
    )
    for name, run in report["precisions"].items():
        if "error" in run:
            print(f"{name}: error: {run['error']}")
            continue
        eng = run["engine"]
        print(
            f"{name} ({run['dtype']}{', ' + run['quantization'] if run['quantization'] else ''} weights, "
            f"{run['kv_dtype']} KV): load {run['load_s']:.1f} s; "
            + ", ".join(f"{LAYOUT_NAMES[k]} {v:.1f} s" for k, v in run["seconds"].items())
            + "; peak KV in use " + ", ".join(f"{LAYOUT_NAMES[k]} {fmt_bytes(eng[k]['peak_kv_bytes'])}" for k in LAYOUTS)
            + "; prefix-hit tokens " + ", ".join(f"{LAYOUT_NAMES[k]} {eng[k]['prefix_hit_tokens']:,}" for k in LAYOUTS)
        )
    hf = report.get("hf")
    if hf:
        print(f"HF transformers (float32): {hf['seconds']:.1f} s, against {hf['against']} hybrid")

    # accuracy per task and length: each precision's hybrid / all-full score
    cols = [(name, layout) for name in runs for layout in LAYOUTS]
    head = f"{'task':<16} {'length':>6} {'items':>5}" + "".join(
        f" {name + (' hyb' if layout == 'hybrid' else ' full') + ' %':>11}" for name, layout in cols
    )
    if hf:
        head += f" {'HF %':>7}"
    print("score (mean %) per task and length:")
    print(head)
    by_row = {name: run["accuracy"] for name, run in runs.items()}
    keys = [(r["task"], r["length"], r["items"]) for r in next(iter(by_row.values()))] if by_row else []
    for i, (task, length, count) in enumerate(keys):
        line = f"{task:<16} {'-' if length <= 0 else str(length):>6} {count:>5}"
        line += "".join(f" {by_row[name][i][layout]:>11.1f}" for name, layout in cols)
        if hf:
            line += f" {hf['accuracy'][i]['hf']:>7.1f}"
        print(line)

    for name, run in runs.items():
        differ = run["differ"]
        if differ:
            print(f"{name}: outputs differing between hybrid and all-full: {len(differ)} of {n}")
            for d in differ:
                print(f"  {d['id']}: hybrid {d['hybrid']!r} / all-full {d['full']!r}")
    if hf:
        print(f"outputs differing between {hf['against']} hybrid and HF transformers: {len(hf['differ'])} of {n}")
        for d in hf["differ"]:
            print(f"  {d['id']}: hybrid {d['hybrid']!r} / HF {d['hf']!r}")

    shown = set()
    for name, run in runs.items():
        if run["kv_dtype"] in shown:
            continue
        shown.add(run["kv_dtype"])
        print(f"KV per request and largest batch in {budget_text} (planner Grouping, {run['kv_dtype']} KV):")
        print(f"{'length':>6} {'hybrid':>12} {'all-full':>12} {'ratio':>6} {'batch hybrid':>13} {'batch all-full':>15}")
        for row in run["kv"]:
            ratio = row["full_bytes"] / row["hybrid_bytes"]
            print(
                f"{row['length']:>6} {fmt_bytes(row['hybrid_bytes']):>12} {fmt_bytes(row['full_bytes']):>12} "
                f"{ratio:>5.2f}x {row['hybrid_batch']:>13} {row['full_batch']:>15}"
            )

    ref = report["reference"]
    print(f"summary ({n} items; agreement: hybrid output tokens against {ref or 'no reference'} hybrid's):")
    print(
        f"{'precision':<12} {'score hybrid %':>14} {'score all-full %':>16} {'differ hyb/full':>15} "
        f"{'agree exact':>14} {'mean prefix':>11}"
    )
    for row in report["summary"]:
        if "error" in row:
            print(f"{row['precision']:<12} error: {row['error']}")
            continue
        agree = row["agreement"]
        exact = "-" if agree is None else f"{agree['exact']}/{agree['items']} {100 * agree['exact_fraction']:.0f}%"
        prefix = "-" if agree is None else f"{agree['mean_prefix']:.3f}"
        print(
            f"{row['precision']:<12} {row['score_hybrid']:>14.1f} {row['score_full']:>16.1f} "
            f"{str(row['differ']) + '/' + str(row['items']):>15} {exact:>14} {prefix:>11}"
        )
    if ref is None:
        print(f"  (agreement needs {REFERENCE} among --precisions)")


# --------------------------------------------------------------------- main
def evaluate_model(model: EvalModel, args) -> dict[str, Any]:
    """Build the items with the model's tokenizer; at each precision load the model once, run
    the items in both layouts, score and compare (layouts with each other, precisions with fp32)."""
    from hybridkv.errors import HybridKVError

    path = gguf_path(model.name)
    tok = load_tokenizer(path)
    render, encode = renderer(model, tok), encoder(model, tok)
    items: list[data.Item] | None = None
    prompts: list[list[int]] = []
    lengths: list[int] = []
    max_len = build_s = 0
    eos: Sequence[int] = ()
    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, list[list[int]]]] = {}  # precision -> layout -> ids per item
    groups: dict[str, list[str]] = {}
    num_layers = 0
    for name in args.precisions:
        precision = PRECISIONS[name]
        gc.collect()
        try:
            start = time.perf_counter()
            causal_lm = load_precision(path, precision)
            load_s = time.perf_counter() - start
            if items is None:  # the items depend on the tokenizer and the model's positions only
                max_pos = causal_lm.max_position_embeddings
                lengths = [n for n in args.lengths if n <= max_pos]
                if len(lengths) < len(args.lengths):
                    skipped = sorted(set(args.lengths) - set(lengths))
                    print(f"{model.name}: skipping lengths over its {max_pos:,} positions: {skipped}")
                start = time.perf_counter()
                built = data.make_items(
                    args.tasks, lengths, args.items_per_length, seed=args.seed,
                    count_tokens=lambda text: len(encode(text)), render=render, qa_items=args.qa_items,
                )
                prompts = [encode(render(it)) for it in built]
                build_s = time.perf_counter() - start
                max_len = min(max_pos, max([*lengths, *(len(p) + it.max_tokens for p, it in zip(prompts, built))]))
                eos = causal_lm.eos_token_ids
                items = built
            out, seconds, extras, groupings = {}, {}, {}, {}
            for layout in LAYOUTS:
                gc.collect()
                run = run_engine(causal_lm, prompts, items, layout == "hybrid", args, max_len, precision)
                out[layout], seconds[layout], extras[layout], groupings[layout] = run
                print(f"{model.name} {name} {layout}: {seconds[layout]:.1f} s ({extras[layout]})", flush=True)
        except HybridKVError as e:  # this precision cannot run here (e.g. no int4 group size fits): report it
            print(f"{model.name} {name}: error: {e}", flush=True)
            runs[name] = {"error": str(e)}
            continue
        finally:
            causal_lm = None
            gc.collect()
        outputs[name] = out
        groups = {k: extras[k]["groups"] for k in LAYOUTS}
        num_layers = groupings["hybrid"].num_layers
        runs[name] = {
            "dtype": precision.dtype,
            "quantization": precision.quantization,
            "kv_dtype": precision.dtype if precision.kv_cache_dtype == "auto" else precision.kv_cache_dtype,
            "load_s": load_s,
            "seconds": seconds,
            "engine": extras,
            "kv": kv_rows(groupings, lengths or [max_len], args.kv_budget_bytes),
        }
    if items is None:
        raise ValueError(f"{model.name}: no precision could run: " + "; ".join(r["error"] for r in runs.values()))

    texts = {p: {k: [tok.decode(ids, skip_special_tokens=True) for ids in v] for k, v in o.items()} for p, o in outputs.items()}
    scores = {p: {k: [data.score(t, it.answers) for t, it in zip(v, items)] for k, v in tx.items()} for p, tx in texts.items()}
    reference = REFERENCE if REFERENCE in outputs else None

    def differing(ref_texts, ref_ids, other_texts, other_ids, other: str) -> list[dict[str, str]]:
        return [
            {"id": it.id, "hybrid": ref_texts[i], other: other_texts[i]}
            for i, it in enumerate(items)
            if other_ids[i] != ref_ids[i]
        ]

    for name, out in outputs.items():
        run = runs[name]
        run["accuracy"] = accuracy_rows(items, scores[name], out)
        run["differ"] = differing(texts[name]["hybrid"], out["hybrid"], texts[name]["full"], out["full"], "full")
        run["agreement"] = None if reference is None else agreement(out["hybrid"], outputs[reference]["hybrid"])

    hf, hf_ids = None, []
    if args.hf:
        against = reference or next(iter(outputs))
        hf_ids, hf_s = run_hf(path, prompts, items, eos)
        print(f"{model.name} HF: {hf_s:.1f} s", flush=True)
        hf_texts = [tok.decode(ids, skip_special_tokens=True) for ids in hf_ids]
        hf_scores = [data.score(t, it.answers) for t, it in zip(hf_texts, items)]
        hf = {
            "against": against,
            "seconds": hf_s,
            "accuracy": accuracy_rows(
                items, {"hybrid": scores[against]["hybrid"], "hf": hf_scores},
                {"hybrid": outputs[against]["hybrid"], "hf": hf_ids},
            ),
            "differ": differing(texts[against]["hybrid"], outputs[against]["hybrid"], hf_texts, hf_ids, "hf"),
            "agreement": agreement(hf_ids, outputs[against]["hybrid"]),
        }
        texts["hf"], scores["hf"] = {"hf": hf_texts}, {"hf": hf_scores}

    report = {
        "model": model.name,
        "label": model.label,
        "gguf": str(path),
        "num_layers": num_layers,
        "groups": groups,
        "lengths": lengths,
        "build_items_s": build_s,
        "prompt_tokens": sum(map(len, prompts)),
        "reference": reference,
        "precisions": runs,
        **({"hf": hf} if hf else {}),
        "items": [
            {
                **{k: v for k, v in asdict(it).items() if k not in ("instruction", "context", "needles")},
                "prompt_tokens": len(p),
                "outputs": {lane: {k: v[i] for k, v in tx.items()} for lane, tx in texts.items()},
                "output_token_ids": {
                    **{lane: {k: v[i] for k, v in o.items()} for lane, o in outputs.items()},
                    **({"hf": {"hf": hf_ids[i]}} if hf else {}),
                },
                "scores": {lane: {k: v[i] for k, v in sc.items()} for lane, sc in scores.items()},
                "agreement": {
                    lane: {
                        "exact": o["hybrid"][i] == outputs[reference]["hybrid"][i],
                        "prefix_tokens": common_prefix(o["hybrid"][i], outputs[reference]["hybrid"][i]),
                        "prefix": prefix_fraction(o["hybrid"][i], outputs[reference]["hybrid"][i]),
                    }
                    for lane, o in outputs.items()
                } if reference else {},
            }
            for i, (it, p) in enumerate(zip(items, prompts))
        ],
    }
    report["summary"] = summary_rows(report)
    return report


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(known: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(known)}")
        return list(dict.fromkeys(names))

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of short items, no multivalue (smoke test)")
    p.add_argument("--models", type=_names(list(MODELS)), default=list(MODELS), help="comma-separated")
    p.add_argument(
        "--precisions", type=_names(list(PRECISIONS)), default=list(PRECISIONS),
        help=f"comma-separated, run in the order {','.join(PRECISIONS)} (default all; {REFERENCE} is the agreement reference)",
    )
    p.add_argument(
        "--tasks", type=_names(list(data.TASKS)), default=None,
        help=f"comma-separated (default all; --quick: {','.join(QUICK['tasks'])})",
    )
    p.add_argument("--lengths", type=_int_list, default=None, help=f"prompt + answer token bounds (default {FULL['lengths']})")
    p.add_argument(
        "--items-per-length", type=int, default=None,
        help=f"haystacks per NIAH task and length (default {FULL['items_per_length']}; multikey asks 4 questions of each)",
    )
    p.add_argument("--qa-items", type=int, default=None, help=f"QA items (default {FULL['qa_items']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-store", choices=("all", "tail"), default="all",
                   help="the engines' --kv-store (the all-full layout has no windowed layer: unchanged)")
    p.add_argument("--kv-budget", default="1GiB", help="KV pool of each engine and the batch-fit budget")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--hf", action="store_true", help="also run transformers (fp32) on the same ids (cross-check)")
    p.add_argument("--json", type=Path, default=None, help="write every item, output and figure here")
    args = p.parse_args(argv)
    args.precisions = [name for name in PRECISIONS if name in args.precisions]  # the reference first
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.items_per_length < 1 or args.qa_items < 0 or args.threads < 1:
        p.error("--items-per-length and --threads must be >= 1, --qa-items >= 0")
    from hybridkv.errors import HybridKVError
    from hybridkv.planner.sizes import parse_bytes

    try:
        args.kv_budget_bytes = parse_bytes(args.kv_budget)
    except HybridKVError as e:
        p.error(f"--kv-budget: {e}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from hybridkv.errors import HybridKVError

    torch.set_num_threads(args.threads)
    print(
        f"eval_parity: models {','.join(args.models)}; precisions {','.join(args.precisions)}; "
        f"tasks {','.join(args.tasks)}; lengths {args.lengths}; "
        f"{args.items_per_length} per NIAH task and length, {args.qa_items} QA; seed {args.seed}; "
        f"kv budget {args.kv_budget}; torch threads {args.threads}",
        flush=True,
    )
    reports = []
    try:
        for name in args.models:
            reports.append(evaluate_model(MODELS[name], args))
    except (HybridKVError, ValueError) as e:
        print(f"eval_parity: error: {e}", file=sys.stderr)
        return 2
    for report in reports:
        print_model(report, args.kv_budget)
    runs = [(r, p, run) for r in reports for p, run in r["precisions"].items() if "error" not in run]
    differ = sum(len(run["differ"]) for _, _, run in runs)
    total = sum(len(r["items"]) for r, _, _ in runs)
    failed = [f"{r['model']} {p}" for r in reports for p, run in r["precisions"].items() if "error" in run]
    print(
        f"\nitems whose outputs differ between hybrid and all-full: {differ} of {total} "
        f"({len(reports)} model(s) x {len(args.precisions)} precision(s); target 0)"
        + (f"; could not run: {', '.join(failed)}" if failed else "")
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "models": reports}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
