"""``hybridkv generate``: text in, text out, on a model name, a ``.gguf`` file or a model directory.

    hybridkv generate gemma-3-270m --prompt "The capital of France is" --max-tokens 32
    hybridkv generate smollm2-135m --chat --system "Be brief." --prompt "What is the capital of Germany?"
    hybridkv generate MODEL --prompts-file prompts.jsonl --stop "\\n\\n" --json
    hybridkv generate MODEL_DIR --prompt-ids 1,2,3 --prompt-ids 1,2,4 --max-tokens 16
    hybridkv generate gemma-3-270m --prompt "..." --no-hybrid      # every layer's KV as full attention

``--prompt`` (repeatable) is text through the model's tokenizer (GGUF metadata or the
directory's ``tokenizer.json``; a directory without one and a vocabulary of >= 256 ids
is read byte-level: token id = UTF-8 byte). ``--chat`` renders each prompt as a user
message with the model's chat template (``--system`` adds a system message).
``--prompts-file`` holds one prompt per line, or JSON lines with ``"prompt"`` (text) or
``"messages"`` (a chat). ``--prompt-ids`` gives token ids; their output prints as ids.

One prompt streams its text to stdout as it is produced. Several run batched and each
prints, under a ``==> prompt N <==`` header, as soon as it and every prompt before it
have finished: the prompts' texts never interleave, and the order is the order given
(``--json``: one object per prompt, the same order). One summary line on stderr ends
the run: tokens, time to first token, tokens/s, KV blocks per group at peak (and their
bytes in the KV cache's dtype), prefix-hit
tokens, preemptions and the KV bytes one request of ``max_model_len`` needs in this
layout vs every layer as full attention (with linear-attention layers, "KV+state": their
state blocks counted too, and given apart; the all-full layout keeps them as states).

Everything that can be checked before the model loads is: the options, the prompts
file, the model (an unknown name prints the pip line; a truncated GGUF is one line),
the tokenizer and the prompts' encoding (a chat template that raises), the KV cache
size against memory. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hybridkv.cli import write_out
from hybridkv.cli.engine_args import add_engine_options, check_kv_pool_fits, engine_config, require_engine_dependencies
from hybridkv.cli.model_dir import resolve_model_source
from hybridkv.cli.options import SEED_MAX, finite_float, int_range
from hybridkv.errors import InvalidArgumentError
from hybridkv.planner.architectures import language_model_config
from hybridkv.planner.presets import load_model_config
from hybridkv.planner.sizes import format_bytes
from hybridkv.sampling_params import SamplingParams

__all__ = ["add_parser", "add_engine_options", "engine_config", "run", "parse_prompt_ids", "read_prompts_file"]


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


def read_prompts_file(path: Path) -> list[str | list[dict]]:
    """The prompts of ``path``: JSON lines (``{"prompt": TEXT}`` or ``{"messages": [...]}``)
    when the first non-blank line starts with ``{``, else one text prompt per non-blank line.
    A bad line is an error naming ``path:LINE``; a file with no prompt is an error too."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"{path} is a folder, not a prompts file") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise InvalidArgumentError(f"{path} holds no prompt")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts: list[str | list[dict]] = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgumentError(f"{path}:{n}: not a JSON object ({str(exc)[:80]})") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise InvalidArgumentError(f'{path}:{n}: expected an object with "prompt" or "messages"')
        prompt = record.get("prompt", record.get("messages"))
        if "prompt" in record and (not isinstance(prompt, str) or not prompt):
            raise InvalidArgumentError(f'{path}:{n}: "prompt" must be a non-empty string')
        if "messages" in record and not (
            isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt)
        ):
            raise InvalidArgumentError(f'{path}:{n}: "messages" must be a list of {{"role", "content"}} strings')
        prompts.append(prompt)
    return prompts


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text with a model (a name, a .gguf file or a model dir)",
                              description="Generate with a model: an installed name (gemma-3-270m, smollm2-135m), "
                                          "a .gguf file or a model directory (config.json + safetensors).")
    p.add_argument("model", metavar="MODEL",
                   help="gemma-3-270m, smollm2-135m, a .gguf file, or a model directory (or its config.json)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="text prompt, through the model's tokenizer; repeatable (default: none)")
    p.add_argument("--chat", action="store_true", help="each prompt is a user message, rendered with the chat template (default: plain text)")
    p.add_argument("--system", metavar="TEXT", default=None, help="with --chat: a system message first (default: none)")
    p.add_argument("--prompts-file", type=Path, default=None, metavar="FILE",
                   help='one prompt per line, or JSON lines with "prompt" or "messages" (default: none)')
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="comma-separated token ids; repeatable; output printed as ids (default: none)")
    p.add_argument("--max-tokens", type=int_range(1), default=16,
                   help="tokens to generate per prompt at most; prompt + max-tokens must fit --max-model-len, "
                        "as in serve (default 16)")
    p.add_argument("--temperature", type=finite_float(0.0), default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    p.add_argument("--top-k", type=int_range(0), default=0, help="sample from the k most likely tokens; 0 = all (default 0)")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=1.0,
                   help="nucleus sampling mass, in (0, 1] (default 1)")
    p.add_argument("--seed", type=int_range(0, SEED_MAX), default=None, help="sampling seed (default: unseeded)")
    p.add_argument("--stop", action="append", default=[], metavar="S",
                   help="a string that ends a prompt's output (left out of it); repeatable (default: none)")
    p.add_argument("--stop-token-ids", action="append", default=[], metavar="IDS",
                   help="comma-separated ids that end a prompt's output (kept in it); repeatable (default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids (default: stop)")
    add_engine_options(p, max_num_seqs_default="the number of prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (default: the text)")
    p.set_defaults(func=run)
    return p


def _prompts(args: argparse.Namespace) -> tuple[list[Any], bool]:
    """The prompts as given (text, chat messages or id lists) and whether they are ids."""
    ids = [parse_prompt_ids(t) for t in args.prompt_ids]
    texts: list[Any] = list(args.prompt)
    if args.prompts_file is not None:
        texts += read_prompts_file(args.prompts_file)
    if ids and texts:
        raise InvalidArgumentError("give --prompt-ids or text prompts (--prompt, --prompts-file), not both")
    if not ids and not texts:
        raise InvalidArgumentError("give at least one --prompt, --prompts-file or --prompt-ids")
    if any(isinstance(t, str) and not t for t in texts):
        raise InvalidArgumentError("a --prompt is empty")
    if args.system is not None and not args.chat:
        raise InvalidArgumentError("--system needs --chat")
    if args.chat:
        if ids:
            raise InvalidArgumentError("--chat takes text prompts, not --prompt-ids")
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        texts = [t if isinstance(t, list) else [*system, {"role": "user", "content": t}] for t in texts]
    return (ids, True) if ids else (texts, False)


def run(args: argparse.Namespace) -> int:
    prompts, ids_mode = _prompts(args)
    stop_ids = tuple(dict.fromkeys(i for t in args.stop_token_ids for i in parse_prompt_ids(t, "--stop-token-ids")))
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        raise InvalidArgumentError("give --num-blocks or --kv-cache-memory, not both")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop_token_ids=stop_ids, ignore_eos=args.ignore_eos,
                        stop=tuple(args.stop))
    source = resolve_model_source(args.model)  # an installed name, a checked GGUF header, or a checked dir
    require_engine_dependencies()
    loaded = load_model_config(source.path)
    check_kv_pool_fits(args, loaded.config, loaded.label)

    from hybridkv.engine.llm import LLM, checkpoint_tokenizer, encode_prompt

    vocab = language_model_config(loaded.config, label=loaded.label)["vocab_size"]
    tokenizer = checkpoint_tokenizer(source, vocab)
    encoded = [encode_prompt(tokenizer, p, vocab) for p in prompts]  # template / tokenizer errors before the load

    llm = LLM(source, engine_config(args, len(prompts)), tokenizer=tokenizer)  # torch from here on
    start = time.perf_counter()
    outputs = _print_outputs(args, llm.stream(encoded, sp), len(prompts), ids_mode)
    elapsed = time.perf_counter() - start
    print(summary_line(llm, outputs, elapsed), file=sys.stderr)
    return 0


def _print_outputs(args: argparse.Namespace, deltas, n: int, ids_mode: bool) -> list:
    """Print as the module docstring says; return the outputs in prompt order."""
    stream = n == 1 and not args.json and not ids_mode
    done: dict[int, Any] = {}
    printed = 0
    for d in deltas:
        if stream:
            if d.text:
                write_out(d.text, end="", flush=True)
            if d.finished:
                write_out("", flush=True)
        if d.output is not None:
            done[d.index] = d.output
        while not stream and printed in done:
            _print_one(args, done[printed], printed, n, ids_mode)
            printed += 1
    return [done[i] for i in range(n)]


def _print_one(args: argparse.Namespace, out, index: int, n: int, ids_mode: bool) -> None:
    if args.json:
        record = {"request_id": out.request_id, "prompt_ids": list(out.prompt_token_ids),
                  "output_ids": list(out.token_ids), "finish_reason": out.finish_reason,
                  "cached_tokens": out.num_cached_tokens, "time_to_first_token": out.time_to_first_token}
        if not ids_mode:
            record["text"] = out.text
        write_out(json.dumps(record, ensure_ascii=False))
    elif ids_mode:
        write_out(",".join(map(str, out.token_ids)))
    else:
        if n > 1:
            write_out(f"==> prompt {index + 1} <==")
        write_out(out.text, flush=True)


def summary_line(llm, outputs: list, elapsed: float) -> str:
    """The one stderr line that ends a run (see the module docstring)."""
    kv = llm.engine.kv_summary()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.time_to_first_token for o in outputs if o.time_to_first_token is not None]
    ttft = f"{sum(ttfts) / len(ttfts):.2f} s" + (" (mean)" if len(ttfts) > 1 else "") if ttfts else "-"
    peaks: dict[str, list[int]] = {}
    for g in kv.groups:
        peaks.setdefault(g.label, []).append(g.peak_blocks)
    blocks = ", ".join(f"{label} {max(p)}" if len(p) == 1 else f"{label} {len(p)}x{max(p)}" for label, p in peaks.items())
    what = "KV+state" if kv.state_bytes_per_request or kv.full_state_bytes_per_request else "KV"

    def amount(total: int, state: int) -> str:
        return format_bytes(total) + (f" ({format_bytes(state)} state)" if state else "")

    mine = amount(kv.kv_bytes_per_request, kv.state_bytes_per_request)
    layout = (
        f"{what}/request at {kv.num_tokens:,} tokens {mine} hybrid vs "
        f"{amount(kv.full_kv_bytes_per_request, kv.full_state_bytes_per_request)} all-full "
        f"(all-full / hybrid {kv.full_over_layout:.2f}x)"
        if kv.hybrid
        else f"{what}/request at {kv.num_tokens:,} tokens {mine} (all-full, --no-hybrid)"
    )
    quantization = llm.engine.quantization
    weights = f"weights {quantization}; " if quantization else ""
    return (
        f"{len(outputs)} prompt{'s' if len(outputs) != 1 else ''}: {prompt_tokens:,} prompt + {output_tokens:,} "
        f"output tokens; TTFT {ttft}; {output_tokens / max(elapsed, 1e-9):.1f} tokens/s; {weights}"
        f"KV blocks peak {blocks} ({format_bytes(kv.peak_bytes)} {llm.engine.config.kv_dtype}); "
        f"prefix hits {kv.prefix_hit_tokens:,} tokens; "
        f"preemptions {kv.num_preemptions}; {layout}"
    )
