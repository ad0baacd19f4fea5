"""``hybridkv generate``: run prompts through a model directory (HF config.json + safetensors).

    hybridkv generate MODEL_DIR --prompt-ids 1,2,3 --prompt-ids 1,2,4 --max-tokens 16
    hybridkv generate MODEL_DIR --prompt "Hello" --max-tokens 32      # byte-level text mode

``--prompt`` encodes text as UTF-8 bytes (token id = byte value, so the model's
vocabulary must hold 256 ids) and prints the output bytes decoded as UTF-8, for
byte-level models. Greedy by default; ``--temperature`` / ``--top-k`` / ``--top-p``
/ ``--seed`` sample. A prompt stops at the model's EOS ids (``eos_token_id`` of
config.json and generation_config.json) unless ``--ignore-eos``, and at any of
``--stop-token-ids`` either way; the stop token is the last one printed. torch is
imported only when the command runs.

Everything is checked before the model loads: the options, the directory (or its
``config.json``), the config (through the planner's reader), the weight files, and
the KV cache size against the memory available (``--num-blocks 100000000000`` is
refused naming the bytes it would take, instead of allocating).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from hybridkv.cli import write_out
from hybridkv.cli.model_dir import check_weight_files, resolve_model_dir
from hybridkv.cli.options import SEED_MAX, finite_float, int_range, memory, tokens
from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, PoolTooSmallError
from hybridkv.planner.architectures import model_layers
from hybridkv.planner.grouping import group_layers
from hybridkv.planner.hf_defaults import DEFAULT_MAX_POSITION_EMBEDDINGS
from hybridkv.planner.presets import load_model_config
from hybridkv.planner.sizes import format_bytes
from hybridkv.scheduler.interface import SamplingParams

__all__ = ["add_parser", "run", "parse_prompt_ids"]


def parse_prompt_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    """"1,2,3" or "1 2 3" -> [1, 2, 3]; ``flag`` names the option in errors ("1,,2" is one:
    an empty item is a typo, not a token to drop)."""
    pieces = text.split(",")
    parts = [part for piece in pieces for part in piece.split()]
    if not parts:
        raise InvalidArgumentError(f"{flag} needs at least one token id")
    if any(not p.strip() for p in pieces):
        raise InvalidArgumentError(f"{flag} has an empty item in {text!r}")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise InvalidArgumentError(f"{flag} takes comma-separated ints, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise InvalidArgumentError(f"token ids must be non-negative, got {text!r}")
    return ids


#: the engine dtypes (model weights and KV cache); EngineConfig's default first
DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate tokens with a local model directory",
                              description="Generate with a model directory (config.json + safetensors).")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (config.json + *.safetensors), or its config.json")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="comma-separated token ids; repeatable (default: none; give this or --prompt)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="text prompt, byte-level (token id = UTF-8 byte); repeatable (default: none)")
    p.add_argument("--max-tokens", type=int_range(1), default=16, help="tokens to generate per prompt at most (default 16)")
    p.add_argument("--temperature", type=finite_float(0.0), default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    p.add_argument("--top-k", type=int_range(0), default=0, help="sample from the k most likely tokens; 0 = all (default 0)")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=1.0,
                   help="nucleus sampling mass, in (0, 1] (default 1)")
    p.add_argument("--seed", type=int_range(0, SEED_MAX), default=None, help="sampling seed (default: unseeded)")
    p.add_argument("--stop-token-ids", action="append", default=[], metavar="IDS",
                   help="comma-separated ids that end a prompt's output (kept in it); repeatable (default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids (default: stop)")
    p.add_argument("--dtype", choices=DTYPES, default=DTYPES[0], help=f"model and KV cache dtype (default {DTYPES[0]})")
    p.add_argument("--block-size", type=int_range(1), default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--num-blocks", type=int_range(2, why=" (the null block and one usable)"), default=None,
                   help="KV cache blocks (default: sized for --max-num-seqs requests of --max-model-len, at most 1 GiB)")
    p.add_argument("--kv-cache-memory", type=memory, default=None,
                   help="KV cache budget instead of --num-blocks, e.g. 256MiB (default: see --num-blocks)")
    p.add_argument("--max-model-len", type=tokens, default=None,
                   help="tokens per request at most, e.g. 4096, 32k, 1M (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int_range(1), default=None,
                   help="requests running at once at most (default: the number of prompts)")
    p.add_argument("--max-num-batched-tokens", type=int_range(1), default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help=f"token budget of one step (chunked prefill) (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off (default on)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (default: one line of ids or text)")
    p.set_defaults(func=run)
    return p


def _require_engine_dependencies() -> None:
    """torch and safetensors, imported here so that a missing one is one line, not a traceback."""
    for module in ("torch", "safetensors"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise InvalidConfigError(
                f"generate needs {module}, which is not installed: pip install 'hybridkv[engine]'"
            ) from None


def _check_pool(args: argparse.Namespace, model_dir: Path) -> None:
    """Refuse a KV cache that fits no block or not in memory, before the model loads.

    The bytes of a block id come from the planner (the engine lays its tensors out the
    same way): ``group_size * 2 * block_size * kv_heads * head_dim * dtype bytes``.
    """
    from hybridkv.engine.kv_storage import check_allocation

    loaded = load_model_config(model_dir)  # bounded keys: a 10**9-layer config stops here
    layers = model_layers(loaded.config, label=loaded.label, block_size=args.block_size, dtype=args.dtype)
    if args.num_blocks is None and args.kv_cache_memory is None:
        return
    max_len = args.max_model_len or layers.max_position_embeddings or DEFAULT_MAX_POSITION_EMBEDDINGS
    per_block = group_layers(
        layers.specs, max_len, max_num_batched_tokens=args.max_num_batched_tokens, memory_bytes=args.kv_cache_memory
    ).bytes_per_block  # the engine groups with the same arguments
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
        what = f"--num-blocks {num_blocks:,} (blocks of {format_bytes(per_block)})"
    else:
        num_blocks = args.kv_cache_memory // per_block
        what = f"--kv-cache-memory {format_bytes(args.kv_cache_memory)}"
        if num_blocks < 2:
            raise PoolTooSmallError(
                f"{what} ({args.kv_cache_memory:,} bytes) fits {num_blocks} KV cache block(s) of "
                f"{format_bytes(per_block)} ({per_block:,} bytes) for this model; 2 are needed (the null "
                f"block and one usable): give at least {format_bytes(2 * per_block)}"
            )
    check_allocation(num_blocks * per_block, "cpu", what)


def run(args: argparse.Namespace) -> int:
    prompts = [parse_prompt_ids(t) for t in args.prompt_ids]
    stop_ids = tuple(dict.fromkeys(i for t in args.stop_token_ids for i in parse_prompt_ids(t, "--stop-token-ids")))
    text_mode = bool(args.prompt)
    if text_mode and prompts:
        raise InvalidArgumentError("give --prompt-ids or --prompt, not both")
    if text_mode:
        prompts = [list(t.encode("utf-8", errors="surrogateescape")) for t in args.prompt]
        if any(not p for p in prompts):
            raise InvalidArgumentError("a --prompt is empty")
    if not prompts:
        raise InvalidArgumentError("give at least one --prompt-ids or --prompt")
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        raise InvalidArgumentError("give --num-blocks or --kv-cache-memory, not both")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop_token_ids=stop_ids, ignore_eos=args.ignore_eos)
    model_dir = resolve_model_dir(args.model_dir)
    _require_engine_dependencies()
    _check_pool(args, model_dir)

    from hybridkv.engine.engine import EngineConfig, LLMEngine  # torch from here on
    from hybridkv.engine.models.weights import checkpoint_files

    check_weight_files(checkpoint_files(model_dir))
    engine = LLMEngine(model_dir, EngineConfig(
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs or len(prompts), dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
    ))
    if text_mode and engine.model.vocab_size < 256:
        raise InvalidArgumentError(f"text mode needs a vocabulary of >= 256 ids, the model has {engine.model.vocab_size}")
    for out in engine.generate(prompts, sp):
        ids = list(out.output_token_ids)
        if args.json:
            record = {"request_id": out.request_id, "prompt_ids": list(out.prompt_token_ids), "output_ids": ids,
                      "finish_reason": out.finish_reason, "cached_tokens": out.num_cached_tokens}
            if text_mode:
                record["text"] = bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
            write_out(json.dumps(record))
        elif text_mode:
            write_out(bytes(t for t in ids if t < 256).decode("utf-8", errors="replace"))
        else:
            write_out(",".join(map(str, ids)))
    return 0
