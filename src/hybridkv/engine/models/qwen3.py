"""Qwen3 (``Qwen3ForCausalLM``), as HF 5.24 runs it: Qwen2's layer rule, Llama's layer, plus

* q and k get a per-head RMSNorm (``q_norm`` / ``k_norm``, weights of size ``head_dim``)
  *before* RoPE: ``rope(q_norm(q_proj(x).view(T, Hq, D)))``;
* ``attention_bias`` (default false) puts biases on q, k, v *and* o; the MLP has none;
* ``head_dim`` defaults to 128, not ``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

import torch

from hybridkv.engine.attention import AttentionMetadata
from hybridkv.engine.models.decoder import Rope
from hybridkv.engine.models.llama import LlamaAttention, LlamaForCausalLM, qk_norm_decode_parts
from hybridkv.engine.models.norms import RMSNorm, rms_norm_heads
from hybridkv.engine.models.rope import apply_rotate_half

__all__ = ["Qwen3ForCausalLM"]


class Qwen3Attention(LlamaAttention):
    """Llama's attention with per-head q/k RMSNorms before RoPE."""

    def __init__(self, model: "Qwen3ForCausalLM", layer_idx: int, bias: bool) -> None:
        super().__init__(model, layer_idx, model.attention_type(layer_idx), qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(model.head_dim, model.eps)
        self.k_norm = RMSNorm(model.head_dim, model.eps)
        self._qk_norm: dict = {}  # q_norm's and k_norm's multipliers stacked per head (rms_norm_heads)

    def decode_parts(self, qk_norm=None):
        """:meth:`LlamaAttention.decode_parts` with q_norm's and k_norm's multipliers per head."""
        return qk_norm_decode_parts(self, Qwen3Attention)

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qk, v = self.project_qk_v(x)  # [T, Hq + Hkv, D], [T, Hkv, D]
        qk = rms_norm_heads(qk, ((self.q_norm, self.num_heads), (self.k_norm, self.num_kv_heads)), self._qk_norm)
        cos, sin = rope[self.rope_name]
        q, k = self.split_qk(apply_rotate_half(qk, cos, sin, fused=self.cpu_kernels))
        return q, k, v


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = "qwen3"

    def _make_attention(self, i: int) -> LlamaAttention:
        return Qwen3Attention(self, i, bias=bool(self.config.get("attention_bias", False)))
