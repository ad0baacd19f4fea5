"""``hybridkv simulate``: one workload through a hybrid and an all-full KV cache.

    hybridkv simulate llama4-scout --memory 80GiB --workload long-doc
    hybridkv simulate gemma-3-27b --memory 24GiB --workload chat --plot out.png
    hybridkv simulate mistral-7b --workload trace.jsonl --json

Both layouts get the same byte budget (``hybridkv plan``'s two columns), the same
scheduler limits and the same seeded requests; the table shows steps to finish,
tokens per step, KV usage, running requests, preemptions and prefix-cache hits.
``--json`` prints the same summary as JSON; ``--json-series`` adds each step's KV
usage and running requests. Every option (the plot path, the trace) is checked
before the simulation starts. The trace format is
:data:`hybridkv.scheduler.workloads.TRACE_FORMAT` (shown by ``--help``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridkv.cli import write_out
from hybridkv.cli.options import SEED_MAX, int_range, memory, tokens
from hybridkv.errors import InvalidArgumentError, PoolTooSmallError
from hybridkv.planner.plan import plan_model
from hybridkv.planner.sizes import format_bytes
from hybridkv.scheduler.config import ADMISSION_POLICIES, SchedulerConfig
from hybridkv.scheduler.simulator import SimulationResult, simulate
from hybridkv.scheduler.workloads import TRACE_FORMAT, WORKLOADS, load_trace, make_workload

__all__ = ["add_parser", "run", "render_results"]

DEFAULT_MEMORY = "80GiB"
DEFAULT_MAX_MODEL_LEN = "128K"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="run a workload through hybrid and all-full KV caches",
        description="Run a seeded workload (or a JSONL trace) through a hybrid and an all-full KV cache.",
        epilog=TRACE_FORMAT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", metavar="CONFIG_OR_PRESET", help="preset name, config.json path, or model directory")
    p.add_argument("--memory", type=memory, default=DEFAULT_MEMORY,
                   help=f"KV cache memory budget, e.g. 80GiB, 80GB (default {DEFAULT_MEMORY})")
    p.add_argument("--workload", default="long-doc",
                   help=f"{', '.join(sorted(WORKLOADS))}, or a JSONL trace path (format below; default long-doc)")
    p.add_argument("--num-requests", type=int_range(1, 1_000_000), default=64,
                   help="requests of a synthetic workload (default 64)")
    p.add_argument("--seed", type=int_range(0, SEED_MAX), default=0, help="synthetic workload seed (default 0)")
    p.add_argument("--max-model-len", type=tokens, default=DEFAULT_MAX_MODEL_LEN,
                   help=f"tokens per request at most, e.g. 32768, 128k, 1M (default {DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--block-size", type=int_range(1), default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int_range(1), default=8192,
                   help="token budget of a scheduler step (default 8192)")
    p.add_argument("--max-num-seqs", type=int_range(1), default=256, help="running requests at most (default 256)")
    p.add_argument("--admission", choices=ADMISSION_POLICIES, default=ADMISSION_POLICIES[0],
                   help="when a waiting request starts: full_prompt (its whole prompt fits the free blocks, vLLM's "
                   "default) or first_chunk (its first prefill chunk fits) (default full_prompt)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off in both runs (default on)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="draw KV usage and running requests to FILE, e.g. out.png or out.svg (needs matplotlib; "
                        "default: no plot)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (default: a table)")
    p.add_argument("--json-series", action="store_true",
                   help="like --json, plus each step's kv_usage and running requests (default off)")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="force the progress bar on stderr (default: on when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (default: see --progress)")
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
    lines.append(f"{'admission':<{width}}  " + "  ".join(f"{s['admission']:>12}" for s in summaries))
    hybrid, full = summaries
    if hybrid["steps"]:
        lines.append(f"full / hybrid steps: {full['steps'] / hybrid['steps']:.2f}x")
    return "\n".join(lines)


def _is_trace_path(workload: str) -> bool:
    if not workload.strip():
        return False
    path = Path(workload)
    return path.suffix == ".jsonl" or path.exists() or len(path.parts) > 1


def run(args: argparse.Namespace) -> int:
    if args.plot:
        from hybridkv.scheduler.plot import check_plot_path

        check_plot_path(args.plot)
    max_len = args.max_model_len
    plan = plan_model(args.config, memory=args.memory, max_model_len=max_len, block_size=args.block_size,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    for layout in (plan.hybrid, plan.full):  # the planner checks the hybrid one; both run here
        if layout.num_blocks < 2:
            raise PoolTooSmallError(
                f"--memory {format_bytes(plan.memory_bytes)} holds {layout.num_blocks} block(s) of "
                f"{format_bytes(layout.bytes_per_block)} in the {layout.name} layout of {plan.model.name}; "
                f"both layouts run, and each needs 2 blocks (the null block and one usable): give at least "
                f"{format_bytes(2 * layout.bytes_per_block)}"
            )
    if args.workload in WORKLOADS:
        trace = make_workload(
            args.workload, num_requests=args.num_requests, max_model_len=max_len,
            chunk=_scale(plan.model.specs), seed=args.seed,
        )
        label = f"{args.workload} x{args.num_requests} (seed {args.seed})"
    elif _is_trace_path(args.workload):
        trace = load_trace(args.workload, max_model_len=max_len)
        label = args.workload
    else:
        raise InvalidArgumentError(
            f"unknown workload {args.workload!r}; expected one of {sorted(WORKLOADS)} or a .jsonl trace path"
        )
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, max_model_len=max_len,
        admission=args.admission,
    )
    results = [
        simulate(layout.name, layout.kv_cache_config, trace, sched_cfg, bytes_per_block=layout.bytes_per_block,
                 enable_caching=not args.no_prefix_caching, progress=args.progress)
        for layout in (plan.hybrid, plan.full)
    ]
    title = f"{plan.model.name}: {label}, {format_bytes(plan.memory_bytes)} KV cache, max_model_len {max_len}"
    as_json = args.json or args.json_series
    if as_json:
        summaries = [r.summary() for r in results]
        if args.json_series:
            for summary, r in zip(summaries, results):
                summary["series"] = {"kv_usage": [round(u, 4) for u in r.usage], "running": r.running}
        write_out(json.dumps({"model": plan.model.name, "workload": label, "results": summaries}))
    else:
        write_out(render_results(title, results))
    if args.plot:
        from hybridkv.scheduler.plot import plot_results

        path = plot_results(results, args.plot, title)
        if not as_json:
            write_out(f"plot written to {path}")
    return 0
