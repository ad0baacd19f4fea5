"""GGUF tensors as an HF checkpoint: names, layouts and values transformers would load.

llama.cpp's converter renames HF tensors (one table per family below, the reverse of
``gguf.get_tensor_name_map``), quantizes them, and changes two layouts on the way; this
module undoes each, as transformers 5.24 does (``modeling_gguf_pytorch_utils.py``):

- ``llama``: q_proj / k_proj rows are permuted so each head's rotary pairs sit side by
  side (llama.cpp's ``LlamaModel.permute``: HF rows ``[h, 2, d/2]`` stored as ``[h, d/2, 2]``):
  for one head of ``d = 6``, HF rows ``(0, 1, 2, 3, 4, 5)`` are stored as ``(0, 3, 1, 4, 2, 5)``.
  Undone per head by the inverse swap; k_proj uses the KV head count.
- ``gemma3``: every ``*norm.weight`` was stored ``+ 1`` (HF's Gemma RMSNorm multiplies by
  ``1 + w``, llama.cpp's by ``w``); 1 is subtracted in fp32, as transformers does.
- shapes: GGUF's ggml dims are reversed (numpy order), which is HF's ``[out, in]``.
- a tied head: llama.cpp writes no ``output.weight``; the config says
  ``tie_word_embeddings`` and the loader ties ``lm_head`` to the embedding.

Values are dequantized to fp32 with ``gguf.quants.dequantize`` (the package's own
routines); a type it cannot dequantize is an UnsupportedQuantizationError naming the
supported ones, raised before any tensor is read.
"""

from __future__ import annotations

from typing import Any, Collection, Iterator, Mapping

import torch

from hybridkv.checkpoint.gguf_file import GGUFFile, GGUFTensorInfo
from hybridkv.errors import UnsupportedQuantizationError

__all__ = [
    "GGUF_LAYER_NAMES",
    "GGUF_GLOBAL_NAMES",
    "hf_tensor_name",
    "supported_quant_types",
    "check_quant_types",
    "gguf_weight_plan",
    "gguf_tensors",
    "permuted_heads",
    "unpermute_rows",
]

#: whole-model tensors, every family
GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: GGUF ``general.architecture`` -> per-layer GGUF name (``blk.{i}.<name>``) -> HF name (``model.layers.{i}.<name>``)
GGUF_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORM},
    "gemma3": {
        **_LLAMA,
        **_QK_NORM,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
#: tensors llama.cpp adds that HF checkpoints do not have: Llama 3's precomputed rope
#: frequency factors (transformers drops them too and reads the rope from the config)
_DROPPED = frozenset({"rope_freqs.weight"})
#: architectures whose q/k rows llama.cpp permutes (its LlamaModel; Qwen and Gemma converters do not)
_PERMUTED = frozenset({"llama"})
#: architectures whose norm weights llama.cpp stores + 1
_NORM_PLUS_ONE = frozenset({"gemma3"})


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """The HF name of GGUF tensor ``gguf_name`` (None: dropped; an unknown one comes back as is,
    so the loader reports it among the unknown tensors).

    >>> hf_tensor_name("gemma3", "blk.3.ffn_norm.weight"), hf_tensor_name("llama", "blk.3.ffn_norm.weight")
    ('model.layers.3.pre_feedforward_layernorm.weight', 'model.layers.3.post_attention_layernorm.weight')
    >>> hf_tensor_name("llama", "output.weight"), hf_tensor_name("llama", "rope_freqs.weight")
    ('lm_head.weight', None)
    """
    if gguf_name in _DROPPED:
        return None
    base, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return gguf_name
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        hf = GGUF_LAYER_NAMES.get(arch, {}).get(parts[2])
        if hf is not None:
            return f"model.layers.{int(parts[1])}.{hf}.{suffix}"
    return gguf_name


def supported_quant_types() -> tuple[str, ...]:
    """The ggml type names ``gguf.quants.dequantize`` handles (F32, F16 and its quant classes)."""
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", {})
    return ("F32", "F16", *sorted(t.name for t in traits))


def check_quant_types(gguf: GGUFFile) -> None:
    """UnsupportedQuantizationError naming every tensor whose type cannot be dequantized."""
    supported = set(supported_quant_types())
    bad = [f"{t.name} ({t.type_name})" for t in gguf.tensors if t.type_name not in supported and t.name not in _DROPPED]
    if bad:
        shown = ", ".join(bad[:8]) + (f", ... ({len(bad) - 8} more)" if len(bad) > 8 else "")
        raise UnsupportedQuantizationError(
            f"{gguf.path}: tensors in types hybridkv cannot dequantize: {shown}; "
            f"supported: {', '.join(supported_quant_types())}"
        )


def gguf_weight_plan(gguf: GGUFFile) -> list[tuple[str, tuple[int, ...], GGUFTensorInfo]]:
    """(HF name, shape, GGUF tensor) of every tensor the file gives the model, in file order."""
    arch = gguf.architecture or ""
    plan = []
    for info in gguf.tensors:
        name = hf_tensor_name(arch, info.name)
        if name is not None:
            plan.append((name, info.shape, info))
    return plan


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's rotary row permutation of a q / k weight (or bias) ``w`` [n_head * d, ...]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(arch: str, gguf_name: str, config: Mapping[str, Any]) -> int | None:
    """The head count whose rotary row permutation llama.cpp applied to tensor ``gguf_name``
    (None: stored in HF's row order)."""
    if arch in _PERMUTED and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
        if heads is not None and kv_heads is not None:
            return heads if ".attn_q." in gguf_name else kv_heads
    return None


def _convert(arch: str, gguf_name: str, w, config: Mapping[str, Any]):
    """The HF layout / values of dequantized GGUF tensor ``w`` (fp32 numpy)."""
    heads = permuted_heads(arch, gguf_name, config)
    if heads is not None:
        w = unpermute_rows(w, heads)
    if arch in _NORM_PLUS_ONE and "norm.weight" in gguf_name:
        w = w - 1  # fp32 - 1, as transformers
    return w


def gguf_tensors(gguf: GGUFFile, config: Mapping[str, Any],
                 skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors as (HF name, fp32 tensor), converted to HF's layout, but those whose HF
    names are in ``skip`` (not read at all); checks every tensor's type first, so an unsupported
    one fails before anything is read."""
    import numpy as np
    from gguf.quants import dequantize

    check_quant_types(gguf)
    arch = gguf.architecture or ""
    for name, shape, info in gguf_weight_plan(gguf):
        if name in skip:
            continue
        w = dequantize(gguf.raw(info), info.ggml_type)  # fp32, numpy-order shape
        w = _convert(arch, info.name, w, config)
        if not (w.flags.writeable and w.flags.c_contiguous and w.dtype == np.float32):  # a view of the mapping
            w = np.array(w, dtype=np.float32, order="C")
        yield name, torch.from_numpy(w).reshape(shape)
