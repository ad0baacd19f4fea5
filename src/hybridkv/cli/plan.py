"""``hybridkv plan``: a model's KV cache layout under a memory budget, hybrid vs full.

    hybridkv plan llama4-scout --memory 80GiB --max-model-len 1M
    hybridkv plan path/to/config.json --memory 24GiB --max-model-len 128k --json

CONFIG_OR_PRESET is a bundled preset (see ``hybridkv.planner.presets``), a
``config.json`` path, or a directory holding one. Sizes: ``--memory`` takes explicit
units (80GiB = 80 * 2**30, 80GB = 80 * 10**9); ``--max-model-len`` follows vLLM
(1k = 1000, 1K = 1024, 1m = 10**6, 1M = 2**20) and defaults to the model's
``max_position_embeddings``. The KV cache's dtype follows the engine's rule
(:func:`~hybridkv.core.specs.kv_cache_dtype`): ``--kv-cache-dtype auto`` is the model's dtype,
here the config's unless ``--dtype`` says; ``generate`` / ``serve`` run float32 by default, so
``--dtype float32`` plans what they allocate.
"""

from __future__ import annotations

import argparse
import json

from hybridkv.cli import write_out
from hybridkv.cli.options import int_range, memory, tokens
from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybridkv.core.specs import kv_cache_dtype
from hybridkv.planner.plan import plan_model
from hybridkv.planner.presets import preset_names
from hybridkv.planner.report import plan_to_dict, render_plan

__all__ = ["add_parser", "run"]

DEFAULT_MEMORY = "80GiB"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="plan a model's KV cache layout for a memory budget",
        description="Plan a model's KV cache layout under a memory budget, hybrid vs all-full attention.",
        epilog=f"presets: {', '.join(preset_names())}",
    )
    parser.add_argument("config", metavar="CONFIG_OR_PRESET", help="preset name, config.json path, or model directory")
    parser.add_argument("--memory", type=memory, default=DEFAULT_MEMORY,
                        help=f"KV cache memory budget, e.g. 80GiB, 80GB, 512MiB (default {DEFAULT_MEMORY})")
    parser.add_argument("--max-model-len", type=tokens, default=None,
                        help="tokens per request, e.g. 1M, 128k, 32768 (default: the model's max_position_embeddings)")
    parser.add_argument("--block-size", type=int_range(1), default=16, help="tokens per KV cache block (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int_range(1), default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="tokens the scheduler computes per step; a prefill chunk this long sits on top of a "
                        f"window / chunk in the per-request bound (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--dtype", default=None,
                        help="the model's dtype, e.g. bfloat16 (default: the config's, as vLLM's --dtype auto; "
                        "hybridkv's engine runs float32 unless told)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the KV cache's dtype, e.g. bfloat16, float32, fp8: auto is the model's (--dtype), the "
                        "rule generate / serve follow (default auto)")
    parser.add_argument("--kv-store", choices=("all", "tail"), default="all",
                        help="which K/V windowed layers store: all (as vLLM) or tail (only what later tokens read; "
                        "generate / serve --kv-store) (default all)")
    parser.add_argument("--no-hybrid", action="store_true",
                        help="use the all-full-attention layout (hybrid KV cache management off; default on)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (default: a table)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    plan = plan_model(
        args.config,
        memory=args.memory,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        dtype=kv_cache_dtype(args.kv_cache_dtype, args.dtype),
        hybrid=not args.no_hybrid,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tail_only=args.kv_store == "tail",
    )
    if args.json:
        write_out(json.dumps(plan_to_dict(plan), indent=2))
    else:
        write_out(render_plan(plan))
    return 0
