"""The engine's command-line options, one module for ``generate`` and ``serve``: the flags
(:func:`add_engine_options`), the :class:`~hybridkv.engine.engine.EngineConfig` they make
(:func:`engine_config`), the [engine] extra's check and the KV pool's check before the model loads."""

from __future__ import annotations

import argparse
import importlib

from hybridkv.cli.options import int_range, memory, tokens
from hybridkv.core.specs import kv_cache_dtype
from hybridkv.engine.attention.registry import backend_names, resolve_backend
from hybridkv.engine_config import DTYPES, ENGINE_DEFAULTS as D, KV_CACHE_DTYPES, KV_STORES, QUANTIZATION_CHOICES
from hybridkv.errors import InvalidConfigError, PoolTooSmallError
from hybridkv.planner.sizes import format_bytes

__all__ = ["DTYPES", "ENGINE_MODULES", "add_engine_options", "check_kv_pool_fits", "engine_config",
           "require_engine_dependencies"]



def add_engine_options(p: argparse.ArgumentParser, *, max_num_seqs_default: str) -> None:
    """The engine's options, shared by ``generate`` and ``serve`` (:func:`engine_config` reads them)."""
    p.add_argument("--no-hybrid", action="store_true",
                   help="keep every layer's KV as full attention (the all-full layout, for comparison; default: hybrid)")
    p.add_argument("--dtype", choices=DTYPES, default=D["dtype"],
                   help=f"model dtype, and the KV cache's unless --kv-cache-dtype (default {D['dtype']})")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=D["kv_cache_dtype"],
                   help="the KV cache's dtype, for any weights (--quantization included): auto is --dtype's; "
                        "bfloat16 / float16 halve float32's bytes a token (attention computed in float32 over "
                        f"the stored values; default {D['kv_cache_dtype']})")
    p.add_argument("--kv-store", choices=KV_STORES, default=D["kv_store"],
                   help="which K/V sliding-window and chunked-local layers store: all (every computed token's, "
                        "as vLLM) or tail (only what later tokens read: a prefill chunk keeps its last W - 1 tokens "
                        "and attends to the rest where they were computed; less KV per prefilling request, prefix "
                        f"hits only where a step ended) (default {D['kv_store']})")
    p.add_argument("--block-size", type=int_range(1), default=D["block_size"],
                   help=f"tokens per KV cache block (default {D['block_size']})")
    p.add_argument("--num-blocks", type=int_range(2, why=" (the null block and one usable)"), default=None,
                   help="KV cache blocks (default: sized for --max-num-seqs requests of --max-model-len, at most 1 GiB)")
    p.add_argument("--kv-cache-memory", type=memory, default=None,
                   help="KV cache budget instead of --num-blocks, e.g. 256MiB (default: see --num-blocks)")
    p.add_argument("--max-model-len", type=tokens, default=None,
                   help="tokens per request at most, e.g. 4096, 32k, 1M (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int_range(1), default=None,
                   help=f"requests running at once at most (default: {max_num_seqs_default})")
    p.add_argument("--max-num-batched-tokens", type=int_range(1), default=D["max_num_batched_tokens"],
                   help=f"token budget of one step (chunked prefill) (default {D['max_num_batched_tokens']})")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off (default on)")
    p.add_argument("--prefix-cache-retention-interval", type=_retention, default=D["prefix_cache_retention_interval"], metavar="N|all",
                   help="state checkpoints kept by linear-attention / SSM layers: 0 the prompt's last (default, "
                        "vLLM's), all every block, N every N tokens (a multiple of the block size)")
    p.add_argument("--device", type=_device, default=D["device"], help=f"cpu, cuda or cuda:N (default {D['device']})")
    p.add_argument("--attention-backend", choices=backend_names(), default=D["attention_backend"],
                   help="paged attention: triton kernels (CUDA), the reference (torch ops), cpu (fused C decode "
                        "kernels, compiled on first use), or auto: triton on CUDA when triton imports, cpu for a "
                        f"--quantization model on a CPU, else the reference (default {D['attention_backend']})")
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=D["quantization"],
                   help="the weights' form. auto (default): a GGUF checkpoint on a CPU with --dtype float32 runs "
                        "its quantized blocks as the file stores them (gguf: Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, "
                        "Q6_K decoded in the C kernels, fp32 activations; other tensors dequantized), anything "
                        "else (safetensors, --device cuda, --dtype bfloat16 / float16) loads the weights "
                        "dequantized to --dtype, as none. none: the exact (dequantized) weights. int8 per "
                        "output channel / int4 in groups of 32, on a CPU, for safetensors checkpoints (on a GGUF "
                        "they quantize its dequantized weights a second time); computed in bf16 where the CPU "
                        "has native bf16 (avx512_bf16), else fp32 (HYBRIDKV_CPU_ISA=avx2 or avx512 lowers the "
                        "CPU level the C kernels are built for)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode steps run eagerly (default: graphs on CUDA with triton)")


def engine_config(args: argparse.Namespace, max_num_seqs: int):
    """The :class:`EngineConfig` of :func:`add_engine_options`' options (imports torch)."""
    import torch

    from hybridkv.engine_config import EngineConfig

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError(f"--device {args.device}: this torch build sees no CUDA device")
    resolve_backend(args.attention_backend, device.type, quantized=args.quantization != "none")  # refused before the model loads
    return EngineConfig(
        device=args.device, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs or max_num_seqs, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_store=args.kv_store,
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


def require_engine_dependencies(command: str = "generate") -> None:
    """The [engine] extra's modules, imported here so that a missing one is one line, not a traceback."""
    for module in ENGINE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            raise InvalidConfigError(
                f"{command} needs {module}, which is not installed: pip install 'hybridkv[engine]'"
            ) from None


def check_kv_pool_fits(args: argparse.Namespace, config: dict, label: str) -> None:
    """Refuse a KV cache that fits no block or not in memory, before the model loads.

    The layout is the engine's (:class:`~hybridkv.engine.kv_layout.KVLayout`, torch-free):
    a block id's bytes are every group's pages (``group_size * page``), and what is
    allocated adds the state pools of linear-attention layers.
    """
    from hybridkv.engine.kv_storage import check_allocation
    from hybridkv.engine.kv_layout import KVLayout

    layout = KVLayout.plan(config, label=label, block_size=args.block_size, dtype=args.dtype,
                               kv_dtype=kv_cache_dtype(args.kv_cache_dtype, args.dtype),
                               max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                               hybrid=not args.no_hybrid, memory_bytes=args.kv_cache_memory,
                               tail_only=args.kv_store == "tail")
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
