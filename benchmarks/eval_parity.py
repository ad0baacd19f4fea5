"""Accuracy parity of the hybrid KV layout against all-full, on real models (issue 11, item 5).

    nice -n 10 python3 benchmarks/eval_parity.py [--quick] [--models gemma-3-270m,smollm2-135m]
        [--lengths 1024,2048,4096,8192] [--items-per-length N] [--qa-items N] [--seed S]
        [--kv-budget 1GiB] [--threads N] [--hf] [--json PATH]

vLLM accepted chunked local attention in its hybrid KV cache manager on an accuracy
table: long-context retrieval and a QA set, "this change" against "baseline", equal
scores. This is that table for our hybrid layout. The items (``_eval_data.py``) are a
seeded RULER-style needle-in-a-haystack set (single needle, multi-key, multi-value) at
each ``--lengths`` bound (prompt + answer tokens, counted with the model's own
tokenizer, needle depths spread over 0-100 %) plus a short-answer QA set; nothing is
downloaded.

Models: Gemma 3 270M base (sliding window 512, every 6th layer full) on plain
completion prompts, and SmolLM2-135M-Instruct (all full attention; 8,192 positions)
through its chat template; both GGUF files from the package index, read by our loader
and tokenizer. Each model runs every item greedy twice through ``LLMEngine``, all
items batched in one ``generate``: with the hybrid layout (``EngineConfig()``) and with
every layer's KV kept as full attention (``EngineConfig(hybrid=False)``), both with a
KV pool of ``--kv-budget`` (fp32 KV, the engine's CPU dtype). Printed per model:
accuracy per task and length for both layouts, the items whose output tokens differ
between them (target 0, each listed), and per context length the KV bytes one request
holds and the largest batch that fits ``--kv-budget`` in each layout, both from the
planner's :class:`~hybridkv.planner.grouping.Grouping` of each engine. ``--hf`` also
runs transformers' own load of the GGUF on the same token ids, one item at a time, as
a cross-check (its accuracy and the items where it differs from the hybrid engine).

The small models score what they score (a 270M base model is weak at 8k): the point is
that the two layouts score the same, item for item.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _eval_data as data  # noqa: E402

QUICK = dict(lengths=[384], items_per_length=1, qa_items=2)
FULL = dict(lengths=[1024, 2048, 4096, 8192], items_per_length=1, qa_items=12)
LAYOUTS = ("hybrid", "full")


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
    causal_lm, prompts: list[list[int]], items: Sequence[data.Item], hybrid: bool, args, max_len: int
) -> EngineRun:
    """All items through one ``LLMEngine.generate`` (batched by the scheduler), greedy."""
    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.scheduler import SamplingParams

    engine = LLMEngine(causal_lm, EngineConfig(hybrid=hybrid, max_model_len=max_len, kv_cache_memory=args.kv_budget))
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
    return EngineRun([list(o.output_token_ids) for o in outs], seconds, extra, engine.grouping)


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


def fmt_bytes(n: int) -> str:
    from hybridkv.planner.sizes import format_bytes

    return format_bytes(n)


def print_model(report: dict[str, Any], lanes: Sequence[str], budget_text: str) -> None:
    names = {"hybrid": "hybrid", "full": "all-full", "hf": "HF"}
    print(f"\n== {report['model']}: {report['label']} ==")
    print(
        f"{report['num_layers']} layers; KV groups hybrid [{', '.join(report['groups']['hybrid'])}], "
        f"all-full [{', '.join(report['groups']['full'])}]; KV dtype {report['kv_dtype']}; "
        f"{len(report['items'])} items, {report['prompt_tokens']:,} prompt tokens; "
        + ", ".join(f"{names[k]} {v:.0f} s" for k, v in report["seconds"].items())
    )
    head = f"{'task':<16} {'length':>6} {'items':>5}" + "".join(f" {names[k] + ' %':>10}" for k in lanes)
    head += "".join(f" {names[k] + '≠hybrid':>10}" for k in lanes if k != "hybrid")
    print(head)
    for row in report["accuracy"]:
        length = "-" if row["length"] <= 0 else str(row["length"])
        line = f"{row['task']:<16} {length:>6} {row['items']:>5}" + "".join(f" {row[k]:>10.1f}" for k in lanes)
        line += "".join(f" {row[k + '_differ']:>10}" for k in lanes if k != "hybrid")
        print(line)
    differ = report["differ"]
    print(f"outputs differing between hybrid and all-full: {len(differ)} of {len(report['items'])}")
    for d in differ:
        print(f"  {d['id']}: hybrid {d['hybrid']!r} / all-full {d['full']!r}")
    if "hf" in lanes:
        print(f"outputs differing between hybrid and HF transformers: {len(report['hf_differ'])}")
        for d in report["hf_differ"]:
            print(f"  {d['id']}: hybrid {d['hybrid']!r} / HF {d['hf']!r}")
    peaks = ", ".join(f"{names[k]} {fmt_bytes(report['engine'][k]['peak_kv_bytes'])}" for k in LAYOUTS)
    hits = ", ".join(f"{names[k]} {report['engine'][k]['prefix_hit_tokens']:,}" for k in LAYOUTS)
    print(f"engine runs: peak KV in use {peaks}; prefix-hit tokens {hits}")
    print(f"KV per request and largest batch in {budget_text} (planner Grouping, {report['kv_dtype']} KV):")
    print(f"{'length':>6} {'hybrid':>12} {'all-full':>12} {'ratio':>6} {'batch hybrid':>13} {'batch all-full':>15}")
    for row in report["kv"]:
        ratio = row["full_bytes"] / row["hybrid_bytes"]
        print(
            f"{row['length']:>6} {fmt_bytes(row['hybrid_bytes']):>12} {fmt_bytes(row['full_bytes']):>12} "
            f"{ratio:>5.2f}x {row['hybrid_batch']:>13} {row['full_batch']:>15}"
        )


# --------------------------------------------------------------------- main
def evaluate_model(model: EvalModel, args) -> dict[str, Any]:
    """Build the items with the model's tokenizer, run them in every lane, score and compare."""
    from hybridkv.engine.models import load_model

    path = gguf_path(model.name)
    tok = load_tokenizer(path)
    render, encode = renderer(model, tok), encoder(model, tok)
    causal_lm = load_model(path, dtype="float32")
    max_pos = causal_lm.max_position_embeddings
    lengths = [n for n in args.lengths if n <= max_pos]
    if len(lengths) < len(args.lengths):
        print(f"{model.name}: skipping lengths over its {max_pos:,} positions: {sorted(set(args.lengths) - set(lengths))}")
    start = time.perf_counter()
    items = data.make_items(
        args.tasks, lengths, args.items_per_length, seed=args.seed,
        count_tokens=lambda text: len(encode(text)), render=render, qa_items=args.qa_items,
    )
    prompts = [encode(render(it)) for it in items]
    build_s = time.perf_counter() - start
    max_len = min(max_pos, max([*lengths, *(len(p) + it.max_tokens for p, it in zip(prompts, items))]))

    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    groupings, extras = {}, {}
    for layout in LAYOUTS:
        gc.collect()
        run = run_engine(causal_lm, prompts, items, layout == "hybrid", args, max_len)
        outputs[layout], seconds[layout], extras[layout], groupings[layout] = run
        print(f"{model.name} {layout}: {seconds[layout]:.1f} s ({extras[layout]})", flush=True)
    eos = causal_lm.eos_token_ids
    del causal_lm
    gc.collect()
    if args.hf:
        outputs["hf"], seconds["hf"] = run_hf(path, prompts, items, eos)
        print(f"{model.name} HF: {seconds['hf']:.1f} s", flush=True)

    texts = {lane: [tok.decode(ids, skip_special_tokens=True) for ids in out] for lane, out in outputs.items()}
    scores = {lane: [data.score(t, it.answers) for t, it in zip(tx, items)] for lane, tx in texts.items()}

    def differing(other: str) -> list[dict[str, str]]:
        return [
            {"id": it.id, "hybrid": texts["hybrid"][i], other: texts[other][i]}
            for i, it in enumerate(items)
            if outputs[other][i] != outputs["hybrid"][i]
        ]

    return {
        "model": model.name,
        "label": model.label,
        "gguf": str(path),
        "num_layers": groupings["hybrid"].num_layers,
        "groups": {k: extras[k]["groups"] for k in LAYOUTS},
        "kv_dtype": "float32",
        "lengths": lengths,
        "build_items_s": build_s,
        "prompt_tokens": sum(map(len, prompts)),
        "seconds": seconds,
        "engine": extras,
        "accuracy": accuracy_rows(items, scores, outputs),
        "differ": differing("full"),
        **({"hf_differ": differing("hf")} if args.hf else {}),
        "kv": kv_rows(groupings, lengths or [max_len], args.kv_budget_bytes),
        "items": [
            {
                **{k: v for k, v in asdict(it).items() if k not in ("instruction", "context", "needles")},
                "prompt_tokens": len(p),
                "outputs": {lane: texts[lane][i] for lane in texts},
                "scores": {lane: scores[lane][i] for lane in scores},
            }
            for i, (it, p) in enumerate(zip(items, prompts))
        ],
    }


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
        return names

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of short items (smoke test)")
    p.add_argument("--models", type=_names(list(MODELS)), default=list(MODELS), help="comma-separated")
    p.add_argument("--tasks", type=_names(list(data.TASKS)), default=list(data.TASKS), help="comma-separated")
    p.add_argument("--lengths", type=_int_list, default=None, help=f"prompt + answer token bounds (default {FULL['lengths']})")
    p.add_argument(
        "--items-per-length", type=int, default=None,
        help=f"haystacks per NIAH task and length (default {FULL['items_per_length']}; multikey asks 4 questions of each)",
    )
    p.add_argument("--qa-items", type=int, default=None, help=f"QA items (default {FULL['qa_items']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-budget", default="1GiB", help="KV pool of each engine and the batch-fit budget")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--hf", action="store_true", help="also run transformers on the same ids (cross-check)")
    p.add_argument("--json", type=Path, default=None, help="write every item, output and figure here")
    args = p.parse_args(argv)
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
        f"eval_parity: models {','.join(args.models)}; tasks {','.join(args.tasks)}; lengths {args.lengths}; "
        f"{args.items_per_length} per NIAH task and length, {args.qa_items} QA; seed {args.seed}; "
        f"kv budget {args.kv_budget}; torch threads {args.threads}",
        flush=True,
    )
    lanes = [*LAYOUTS, *(["hf"] if args.hf else [])]
    reports = []
    try:
        for name in args.models:
            reports.append(evaluate_model(MODELS[name], args))
    except (HybridKVError, ValueError) as e:
        print(f"eval_parity: error: {e}", file=sys.stderr)
        return 2
    for report in reports:
        print_model(report, lanes, args.kv_budget)
    differ = sum(len(r["differ"]) for r in reports)
    total = sum(len(r["items"]) for r in reports)
    print(f"\nitems whose outputs differ between hybrid and all-full: {differ} of {total} (target 0)")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "models": reports}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
