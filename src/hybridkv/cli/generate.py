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
the run: tokens, time to first token, tokens/s, KV blocks per group at peak, prefix-hit
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
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from hybridkv.cli import write_out
from hybridkv.cli.model_dir import resolve_model_source
from hybridkv.cli.options import SEED_MAX, finite_float, int_range, memory, tokens
from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, PoolTooSmallError
from hybridkv.planner.architectures import language_model_config
from hybridkv.planner.presets import load_model_config
from hybridkv.planner.sizes import format_bytes
from hybridkv.scheduler.interface import SamplingParams

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


#: the engine dtypes (model weights and KV cache); EngineConfig's default first
DTYPES = ("float32", "bfloat16", "float16")


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


def add_engine_options(p: argparse.ArgumentParser, *, max_num_seqs_default: str) -> None:
    """The engine's options, shared by ``generate`` and ``serve`` (:func:`engine_config` reads them)."""
    p.add_argument("--no-hybrid", action="store_true",
                   help="keep every layer's KV as full attention (the all-full layout, for comparison; default: hybrid)")
    p.add_argument("--dtype", choices=DTYPES, default=DTYPES[0], help=f"model and KV cache dtype (default {DTYPES[0]})")
    p.add_argument("--block-size", type=int_range(1), default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--num-blocks", type=int_range(2, why=" (the null block and one usable)"), default=None,
                   help="KV cache blocks (default: sized for --max-num-seqs requests of --max-model-len, at most 1 GiB)")
    p.add_argument("--kv-cache-memory", type=memory, default=None,
                   help="KV cache budget instead of --num-blocks, e.g. 256MiB (default: see --num-blocks)")
    p.add_argument("--max-model-len", type=tokens, default=None,
                   help="tokens per request at most, e.g. 4096, 32k, 1M (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int_range(1), default=None,
                   help=f"requests running at once at most (default: {max_num_seqs_default})")
    p.add_argument("--max-num-batched-tokens", type=int_range(1), default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help=f"token budget of one step (chunked prefill) (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off (default on)")
    p.add_argument("--prefix-cache-retention-interval", type=_retention, default=0, metavar="N|all",
                   help="state checkpoints kept by linear-attention / SSM layers: 0 the prompt's last (default, "
                        "vLLM's), all every block, N every N tokens (a multiple of the block size)")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--attention-backend", choices=("auto", "reference", "triton"), default="auto",
                   help="paged attention: triton kernels (CUDA), the reference (torch ops), or auto: triton on "
                        "CUDA when triton imports, else the reference (default auto)")
    p.add_argument("--quantization", choices=("int8", "int4"), default=None,
                   help="weight-only quantization on a CPU: int8 per output channel, int4 in groups of 32 "
                        "(embeddings and output projection included; default: the exact weights)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode steps run eagerly (default: graphs on CUDA with triton)")


def engine_config(args: argparse.Namespace, max_num_seqs: int):
    """The :class:`EngineConfig` of :func:`add_engine_options`' options (imports torch)."""
    import torch

    from hybridkv.engine.engine import EngineConfig
    from hybridkv.engine.kernels import resolve_backend

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError(f"--device {args.device}: this torch build sees no CUDA device")
    resolve_backend(args.attention_backend, device.type)  # refused before the model loads
    return EngineConfig(
        device=args.device, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs or max_num_seqs, dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens, hybrid=not args.no_hybrid,
        prefix_cache_retention_interval=args.prefix_cache_retention_interval,
    )


def _device(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    name = text.strip().lower()
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and (not index.isdigit() or kind == "cpu")):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return name


def _retention(text: str) -> int | None:
    """``--prefix-cache-retention-interval``: "all" (None: every block) or an int >= 0."""
    if text.strip().lower() == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'all' or an int >= 0, got {text!r}")
    return value


#: what the engine imports (the [engine] extra's modules; tqdm only draws a progress bar)
ENGINE_MODULES = ("torch", "safetensors", "numpy", "gguf", "tokenizers", "jinja2")


def _require_engine_dependencies(command: str = "generate") -> None:
    """The [engine] extra's modules, imported here so that a missing one is one line, not a traceback."""
    for module in ENGINE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            raise InvalidConfigError(
                f"{command} needs {module}, which is not installed: pip install 'hybridkv[engine]'"
            ) from None


def _check_pool(args: argparse.Namespace, config: dict, label: str) -> None:
    """Refuse a KV cache that fits no block or not in memory, before the model loads.

    The layout is the engine's (:class:`~hybridkv.engine.layout.EngineLayout`, torch-free):
    a block id's bytes are every group's pages (``group_size * page``), and what is
    allocated adds the state pools of linear-attention layers.
    """
    from hybridkv.engine.kv_storage import check_allocation
    from hybridkv.engine.layout import EngineLayout

    layout = EngineLayout.plan(config, label=label, block_size=args.block_size, dtype=args.dtype,
                               max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                               hybrid=not args.no_hybrid, memory_bytes=args.kv_cache_memory)
    if args.num_blocks is None and args.kv_cache_memory is None:
        return
    per_block = layout.bytes_per_block
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
    check_allocation(layout.allocation_bytes(num_blocks), "cpu", what)


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
    _require_engine_dependencies()
    loaded = load_model_config(source.path)
    _check_pool(args, loaded.config, loaded.label)

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
    quantization = llm.engine.config.quantization
    weights = f"weights {quantization}; " if quantization else ""
    return (
        f"{len(outputs)} prompt{'s' if len(outputs) != 1 else ''}: {prompt_tokens:,} prompt + {output_tokens:,} "
        f"output tokens; TTFT {ttft}; {output_tokens / max(elapsed, 1e-9):.1f} tokens/s; {weights}"
        f"KV blocks peak {blocks} ({format_bytes(kv.peak_bytes)}); prefix hits {kv.prefix_hit_tokens:,} tokens; "
        f"preemptions {kv.num_preemptions}; {layout}"
    )
