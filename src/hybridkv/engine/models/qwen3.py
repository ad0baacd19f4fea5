"""Qwen3 (``Qwen3ForCausalLM``), as HF 5.24 runs it: Qwen2's layer rule, Llama's layer, plus

* q and k get a per-head RMSNorm (``q_norm`` / ``k_norm``, weights of size ``head_dim``)
  *before* RoPE: ``rope(q_norm(q_proj(x).view(T, Hq, D)))``;
* ``attention_bias`` (default false) puts biases on q, k, v *and* o; the MLP has none;
* ``head_dim`` defaults to 128, not ``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

from hybridkv.engine.models.llama import LlamaAttention, LlamaForCausalLM, QKNormAttention

__all__ = ["Qwen3ForCausalLM"]


class Qwen3Attention(QKNormAttention):
    """Llama's attention with per-head q/k RMSNorms before RoPE."""

    def __init__(self, model: "Qwen3ForCausalLM", layer_idx: int, bias: bool) -> None:
        super().__init__(model, layer_idx, model.attention_type(layer_idx), qkv_bias=bias, o_bias=bias)


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = "qwen3"

    def _make_attention(self, i: int) -> LlamaAttention:
        return Qwen3Attention(self, i, bias=bool(self.config.get("attention_bias", False)))
