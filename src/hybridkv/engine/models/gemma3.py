"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``), as HF 5.24 runs it.

Differences from Llama:

* RMSNorm scales by ``(1 + w)``; q and k get a per-head RMSNorm *before* RoPE;
* sandwich norms: ``h + post_attn_norm(attn(input_norm(h)))``, then
  ``h + post_ff_norm(mlp(pre_ff_norm(h)))``;
* the embedding is multiplied by ``sqrt(hidden_size)`` (in the weight dtype);
* scores are scaled by ``query_pre_attn_scalar ** -0.5``;
* ``layer_types`` picks sliding / full per layer (default: every 6th full); the
  sliding layers use their own rope (``rope_parameters["sliding_attention"]``, old
  configs: ``rope_local_base_freq``), the full layers ``rope_parameters["full_attention"]``;
* ``final_logit_softcapping``: ``tanh(logits / c) * c``.

HF 5.24's ``Gemma3Attention`` does *not* pass ``attn_logit_softcapping`` to the
attention function, so attention scores are never soft-capped; we do the same.
``use_bidirectional_attention`` (EmbeddingGemma) is not a causal LM and is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hybridkv.engine.attention import AttentionMetadata, AttentionType
from hybridkv.engine.models.base import (
    CausalLM,
    DecoderLayer,
    DecoderStack,
    RMSNorm,
    Rope,
    attention_types,
    require,
)
from hybridkv.engine.models.llama import GatedMLP, LlamaAttention
from hybridkv.engine.models.rope import RotaryEmbedding, apply_rotate_half, rope_parameters
from hybridkv.errors import InvalidConfigError

__all__ = ["Gemma3ForCausalLM"]


class Gemma3Attention(LlamaAttention):
    def __init__(self, model: "Gemma3ForCausalLM", layer_idx: int, attn_type: AttentionType, rope_name: str) -> None:
        bias = bool(model.config.get("attention_bias", False))
        super().__init__(model, layer_idx, attn_type, qkv_bias=bias, o_bias=bias, rope_name=rope_name)
        self.scale = float(model.config.get("query_pre_attn_scalar", model.head_dim)) ** -0.5
        self.q_norm = RMSNorm(model.head_dim, model.eps, unit_offset=True)
        self.k_norm = RMSNorm(model.head_dim, model.eps, unit_offset=True)

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.project(x)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[self.rope_name]
        return apply_rotate_half(q, cos, sin), apply_rotate_half(k, cos, sin), v


class Gemma3DecoderLayer(DecoderLayer):
    """Sandwich norms: ``h + post_attention_layernorm(a)``, ``h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``."""

    def __init__(self, model: "Gemma3ForCausalLM", layer_idx: int) -> None:
        attn_type = model.attention_type(layer_idx)
        rope_name = "sliding_attention" if attn_type.kind == "sliding" else "full_attention"
        hidden, eps = model.hidden_size, model.eps
        mlp = GatedMLP(
            hidden,
            require(model.config, "intermediate_size"),
            model.config.get("hidden_activation") or model.config.get("hidden_act") or "gelu_pytorch_tanh",
        )
        super().__init__(hidden, eps, Gemma3Attention(model, layer_idx, attn_type, rope_name), mlp, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def attn_branch(self, a: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(a)

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(CausalLM):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        config = dict(config)
        config.setdefault("tie_word_embeddings", True)
        super().__init__(config)
        if config.get("use_bidirectional_attention"):
            raise InvalidConfigError("Gemma 3 with use_bidirectional_attention is not a causal LM")
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        self._types = self._layer_types(config)
        self.rotaries["full_attention"] = RotaryEmbedding(
            self._rope(config, "full_attention"), self.head_dim, self.max_position_embeddings
        )
        self.rotaries["sliding_attention"] = RotaryEmbedding(
            self._rope(config, "sliding_attention"), self.head_dim, self.max_position_embeddings
        )
        layers = [Gemma3DecoderLayer(self, i) for i in range(self.num_layers)]
        norm = RMSNorm(self.hidden_size, self.eps, unit_offset=True)
        self.model = DecoderStack(self.vocab_size, self.hidden_size, layers, norm)
        self._build_head()

    @staticmethod
    def _rope(config: Mapping[str, Any], layer_type: str) -> dict:
        if config.get("rope_parameters") is not None:
            return rope_parameters(config, 0.0, sub_key=layer_type)
        if layer_type == "full_attention":
            return rope_parameters(config, 1_000_000.0)
        return {"rope_type": "default", "rope_theta": float(config.get("rope_local_base_freq", 10_000.0))}

    def _layer_types(self, config: Mapping[str, Any]) -> list[AttentionType]:
        names = config.get("layer_types")
        if names is None:
            pattern = int(config.get("sliding_window_pattern", 6))
            names = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.num_layers)]
        return attention_types(names, self.num_layers, "Gemma 3", sliding_window=config.get("sliding_window"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        scale = torch.tensor(self.hidden_size**0.5, dtype=weight.dtype, device=weight.device)
        return self.model.embed_tokens(input_ids) * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
