"""Quantizing a loaded model's weights in place (:meth:`CausalLM.quantize_weights`).

Which weights: every *weight slot* a module names with ``quant_targets()`` (a linear's own
weight, or a fused q/k/v or gate/up matrix, where a copy goes and which weight it copies),
plus the embedding; a tied output projection shares the embedding's quantized weight. MoE
experts and routers stay as loaded. Afterwards the full-precision matrices are freed (empty
tensors keep their dtype and device), so the model holds its weights once, quantized.
"""

from __future__ import annotations

import torch

from hybridkv.engine.cpu_ops.isa import quantized_compute_dtype
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.layers.quantized_linear import check_quantization, int4_group_size, quantize_weight
from hybridkv.engine.loading.weights import progress
from hybridkv.errors import InvalidConfigError

__all__ = ["quant_slots", "quantize_model", "adopt_quantized_embedding"]


def quant_slots(model) -> list[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """``(module path, module, attribute, weight)`` of every weight slot, in module order (a tied
    output projection left out: it takes the embedding's)."""
    tied = model.tie_word_embeddings
    return [
        (path, m, attr, w)
        for path, m in model.named_modules()
        if m is not model and callable(getattr(m, "quant_targets", None))
        for attr, w in m.quant_targets()
        if not (tied and m is model.lm_head)
    ]


def compute_dtype_here() -> torch.dtype:
    """The compute dtype of quantized weights on this CPU: bf16 where it has native bf16
    arithmetic, else fp32 (:func:`~hybridkv.engine.cpu_ops.isa.quantized_compute_dtype`)."""
    return torch.bfloat16 if quantized_compute_dtype() == "bfloat16" else torch.float32


def quantize_model(model, mode: str, compute_dtype: torch.dtype | None = None) -> None:
    """Quantize ``model``'s weights as ``mode``; the kernels take inputs in ``compute_dtype``
    (None: the CPU's rule, :func:`compute_dtype_here`; see
    :mod:`~hybridkv.engine.layers.quantized_linear` for what it changes). int4 groups of 32 (the input
    sizes must be multiples of 32, else an InvalidConfigError before anything changes).
    CPU only (the C kernels, or torch's where they cannot be built)."""
    embed = model.model.embed_tokens.weight
    check_quantization(mode, embed.device)
    if compute_dtype is None:
        compute_dtype = compute_dtype_here()
    if model.quantization is not None:
        raise InvalidConfigError(f"the weights are already quantized ({model.quantization})")
    slots = quant_slots(model)
    group = int4_group_size([w.shape[1] for *_, w in slots] + [embed.shape[1]]) if mode == "int4" else 0
    for _, m, attr, w in progress(slots, f"quantizing ({mode})"):
        setattr(m, attr, quantize_weight(w, mode, compute_dtype, group))
    adopt_quantized_embedding(model, quantize_weight(embed, mode, compute_dtype, group), mode)


def adopt_quantized_embedding(model, embed_quant, mode: str) -> None:
    """Take ``embed_quant`` as the embedding (and a tied output projection) once every weight slot
    holds its quantized weight; free the full-precision matrices."""
    embed = model.model.embed_tokens.weight
    model.embed_quant = embed_quant
    model.embed_dtype = embed.dtype
    if model.tie_word_embeddings and model.lm_head.weight is embed:
        model.lm_head.packed = embed_quant
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear):
                m.weight.data = m.weight.data.new_empty(0)
            for name in ("qkv_weight", "gate_up_weight"):
                if isinstance(getattr(m, name, None), torch.Tensor):
                    setattr(m, name, getattr(m, name).new_empty(0))
        embed.data = embed.data.new_empty(0)
    model.quantization = mode
