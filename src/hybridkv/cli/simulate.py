"""``hybridkv simulate``: one workload through a hybrid and an all-full KV cache.

    hybridkv simulate llama4-scout --memory 80GiB --workload long-doc
    hybridkv simulate gemma-3-27b --memory 24GiB --workload chat --plot out.png
    hybridkv simulate mistral-7b --workload trace.jsonl --json

Both layouts get the same byte budget (``hybridkv plan``'s two columns), the same
scheduler limits and the same seeded requests; the table shows steps to finish,
tokens per step, KV usage, running requests, preemptions and prefix-cache hits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridkv.planner.plan import plan_model
from hybridkv.planner.sizes import parse_tokens
from hybridkv.scheduler.config import SchedulerConfig
from hybridkv.scheduler.simulator import SimulationResult, simulate
from hybridkv.scheduler.workloads import WORKLOADS, load_trace, make_workload

__all__ = ["add_parser", "run", "render_results"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="run a workload through hybrid and all-full KV caches",
        description="Run a seeded workload (or a JSONL trace) through a hybrid and an all-full KV cache.",
    )
    p.add_argument("config", metavar="CONFIG_OR_PRESET", help="preset name, config.json path, or model directory")
    p.add_argument("--memory", default="80GiB", help="KV cache memory budget (default 80GiB)")
    p.add_argument("--workload", default="long-doc",
                   help=f"{', '.join(sorted(WORKLOADS))}, or a .jsonl trace path (default long-doc)")
    p.add_argument("--num-requests", type=int, default=64, help="requests of a synthetic workload (default 64)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--max-model-len", default="128K", help="tokens per request at most (default 128K)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off in both runs")
    p.add_argument("--plot", metavar="PNG", default=None, help="draw KV usage and running requests to PNG")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _scale(model_specs) -> int:
    """The workload's document scale: the smallest chunk / window of the model (else 8192)."""
    sizes = [s.attention_span for s in model_specs if s.attention_span is not None]
    return max(min(sizes), 256) if sizes else 8192


ROWS = [
    ("steps to finish", "steps", "{}"),
    ("tokens / step", "tokens_per_step", "{:.1f}"),
    ("peak KV usage", "peak_kv_usage", "{:.1%}"),
    ("mean KV usage", "mean_kv_usage", "{:.1%}"),
    ("peak running", "peak_running", "{}"),
    ("mean running", "mean_running", "{:.1f}"),
    ("preemptions", "preemptions", "{}"),
    ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
    ("rejected (too long)", "rejected", "{}"),
    ("blocks in pool", "num_blocks", "{}"),
]


def render_results(title: str, results: list[SimulationResult]) -> str:
    summaries = [r.summary() for r in results]
    width = max(len(label) for label, _, _ in ROWS)
    lines = [title, f"{'':<{width}}  " + "  ".join(f"{s['layout']:>12}" for s in summaries)]
    for label, key, fmt in ROWS:
        lines.append(f"{label:<{width}}  " + "  ".join(f"{fmt.format(s[key]):>12}" for s in summaries))
    lines.append(f"{'admission':<{width}}  {summaries[0]['admission']}")
    hybrid, full = summaries
    if hybrid["steps"]:
        lines.append(f"full / hybrid steps: {full['steps'] / hybrid['steps']:.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    max_len = parse_tokens(args.max_model_len)
    plan = plan_model(args.config, memory=args.memory, max_model_len=max_len, block_size=args.block_size,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    if Path(args.workload).suffix == ".jsonl" or Path(args.workload).exists():
        trace = load_trace(args.workload)
        label = args.workload
    else:
        trace = make_workload(
            args.workload, num_requests=args.num_requests, max_model_len=max_len,
            chunk=_scale(plan.model.specs), seed=args.seed,
        )
        label = f"{args.workload} x{args.num_requests} (seed {args.seed})"
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, max_model_len=max_len
    )
    results = [
        simulate(layout.name, layout.kv_cache_config, trace, sched_cfg, bytes_per_block=layout.bytes_per_block,
                 enable_caching=not args.no_prefix_caching, progress=args.progress)
        for layout in (plan.hybrid, plan.full)
    ]
    title = f"{plan.model.name}: {label}, {args.memory} KV cache, max_model_len {max_len}"
    if args.json:
        payload = {
            "model": plan.model.name,
            "workload": label,
            "results": [
                {**r.summary(), "series": {"kv_usage": [round(u, 4) for u in r.usage], "running": r.running}}
                for r in results
            ],
        }
        print(json.dumps(payload))
    else:
        print(render_results(title, results))
    if args.plot:
        from hybridkv.scheduler.plot import plot_results

        path = plot_results(results, args.plot, title)
        if not args.json:
            print(f"plot written to {path}")
    return 0
