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
"""

from __future__ import annotations

import argparse
import json

from hybridkv.errors import InvalidArgumentError

__all__ = ["add_parser", "run", "parse_prompt_ids"]


def parse_prompt_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    """"1,2,3" or "1 2 3" -> [1, 2, 3]; ``flag`` names the option in errors."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise InvalidArgumentError(f"{flag} needs at least one token id")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise InvalidArgumentError(f"{flag} takes comma-separated ints, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise InvalidArgumentError(f"token ids must be non-negative, got {text!r}")
    return ids


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate tokens with a local model directory",
                              description="Generate with a model directory (config.json + safetensors).")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS", help="comma-separated token ids; repeatable")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="text prompt (byte-level); repeatable")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", action="append", default=[], metavar="IDS",
                   help="comma-separated ids that end a prompt's output (kept in it); repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized for the batch)")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget instead of --num-blocks, e.g. 256MiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    prompts = [parse_prompt_ids(t) for t in args.prompt_ids]
    stop_ids = tuple(dict.fromkeys(i for t in args.stop_token_ids for i in parse_prompt_ids(t, "--stop-token-ids")))
    text_mode = bool(args.prompt)
    if text_mode and prompts:
        raise InvalidArgumentError("give --prompt-ids or --prompt, not both")
    if text_mode:
        prompts = [list(t.encode("utf-8")) for t in args.prompt]
        if any(not p for p in prompts):
            raise InvalidArgumentError("a --prompt is empty")
    if not prompts:
        raise InvalidArgumentError("give at least one --prompt-ids or --prompt")

    from hybridkv.engine.engine import EngineConfig, LLMEngine  # torch from here on
    from hybridkv.scheduler.interface import SamplingParams

    engine = LLMEngine(args.model_dir, EngineConfig(
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=max(len(prompts), 1),
    ))
    if text_mode and engine.model.vocab_size < 256:
        raise InvalidArgumentError(f"text mode needs a vocabulary of >= 256 ids, the model has {engine.model.vocab_size}")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop_token_ids=stop_ids, ignore_eos=args.ignore_eos)
    for out in engine.generate(prompts, sp):
        ids = list(out.output_token_ids)
        if args.json:
            record = {"request_id": out.request_id, "prompt_ids": list(out.prompt_token_ids), "output_ids": ids,
                      "finish_reason": out.finish_reason, "cached_tokens": out.num_cached_tokens}
            if text_mode:
                record["text"] = bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
            print(json.dumps(record))
        elif text_mode:
            print(bytes(t for t in ids if t < 256).decode("utf-8", errors="replace"))
        else:
            print(",".join(map(str, ids)))
    return 0
