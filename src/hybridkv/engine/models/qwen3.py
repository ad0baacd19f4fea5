"""Qwen3 (``Qwen3ForCausalLM``), as HF 5.24 runs it: Qwen2's layer rule, Llama's layer, plus

* q and k get a per-head RMSNorm (``q_norm`` / ``k_norm``, weights of size ``head_dim``)
  *before* RoPE: ``rope(q_norm(q_proj(x).view(T, Hq, D)))``;
* ``attention_bias`` (default false) puts biases on q, k, v *and* o; the MLP has none;
* ``head_dim`` defaults to 128, not ``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

import torch

from hybridkv.engine.attention import AttentionMetadata
from hybridkv.engine.models.base import RMSNorm, Rope
from hybridkv.engine.models.llama import LlamaAttention, LlamaForCausalLM
from hybridkv.engine.models.rope import apply_rotate_half

__all__ = ["Qwen3ForCausalLM"]


class Qwen3Attention(LlamaAttention):
    """Llama's attention with per-head q/k RMSNorms before RoPE."""

    def __init__(self, model: "Qwen3ForCausalLM", layer_idx: int, bias: bool) -> None:
        super().__init__(model, layer_idx, model.attention_type(layer_idx), qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(model.head_dim, model.eps)
        self.k_norm = RMSNorm(model.head_dim, model.eps)

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.project(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[self.rope_name]
        return apply_rotate_half(q, cos, sin), apply_rotate_half(k, cos, sin), v


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = "qwen3"

    def _make_attention(self, i: int) -> LlamaAttention:
        return Qwen3Attention(self, i, bias=bool(self.config.get("attention_bias", False)))
