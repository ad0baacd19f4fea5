"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``), as HF 5.24 runs it.

Also the language model of ``Gemma3ForConditionalGeneration`` checkpoints (``text_config``;
the vision tower is not loaded, see :func:`~hybridkv.engine.loading.weights.language_model_weight_name`).

Differences from Llama:

* RMSNorm scales by ``(1 + w)``; q and k get a per-head RMSNorm *before* RoPE;
* sandwich norms: ``h + post_attn_norm(attn(input_norm(h)))``, then
  ``h + post_ff_norm(mlp(pre_ff_norm(h)))``;
* the embedding is multiplied by ``sqrt(hidden_size)`` (in the weight dtype);
* scores are scaled by ``query_pre_attn_scalar ** -0.5``;
* ``layer_types`` picks sliding / full per layer (default: every 6th full; read by the
  planner); the sliding layers use their own rope (``rope_parameters["sliding_attention"]``,
  old configs: ``rope_local_base_freq``), the full layers ``rope_parameters["full_attention"]``
  (old configs: ``rope_theta`` and ``rope_scaling``);
* ``final_logit_softcapping``: ``tanh(logits / c) * c``.

HF 5.24's ``Gemma3Attention`` does *not* pass ``attn_logit_softcapping`` to the
attention function, so attention scores are never soft-capped; we do the same.
``use_bidirectional_attention`` (EmbeddingGemma) is not a causal LM and is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hybridkv.engine.attention.types import AttentionType
from hybridkv.engine.layers.decoder import DecoderLayer, DecoderStack, describe_layer, require
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.rope import RotaryEmbedding
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.models.llama import GatedMLP, QKNormAttention
from hybridkv.errors import InvalidConfigError

__all__ = ["Gemma3ForCausalLM"]


class Gemma3Attention(QKNormAttention):
    """q/k norms with a unit offset; queries scaled by ``query_pre_attn_scalar ** -0.5``."""

    def __init__(self, model: "Gemma3ForCausalLM", layer_idx: int, attn_type: AttentionType, rope_name: str) -> None:
        bias = bool(model.config.get("attention_bias", False))
        super().__init__(model, layer_idx, attn_type, qkv_bias=bias, o_bias=bias, rope_name=rope_name, unit_offset=True)
        self.scale = float(model.config["query_pre_attn_scalar"]) ** -0.5


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

    def decode_parts(self):
        """:meth:`DecoderLayer.decode_parts` with the sandwich norms."""
        cls = type(self)
        if cls.attn_branch is not Gemma3DecoderLayer.attn_branch or cls.mlp_branch is not Gemma3DecoderLayer.mlp_branch:
            return None
        return describe_layer(self, self.pre_feedforward_layernorm, self.post_attention_layernorm,
                              self.post_feedforward_layernorm)

    def attn_branch(self, a: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm.forward(a)

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm.forward(self.ffn.forward(self.pre_feedforward_layernorm.forward(h)))


class Gemma3ForCausalLM(CausalLM):
    family = "gemma3"

    def __init__(self, config: Mapping[str, Any], label: str = "config") -> None:
        super().__init__(config, label)
        config = self.config
        if config.get("use_bidirectional_attention"):
            raise InvalidConfigError("Gemma 3 with use_bidirectional_attention is not a causal LM")
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        self._embed_scales: dict = {}  # (dtype, device) -> sqrt(hidden_size) in the weight dtype
        for layer_type in ("full_attention", "sliding_attention"):
            self.rotaries[layer_type] = RotaryEmbedding(
                self._rope(config, layer_type), self.head_dim, self.max_position_embeddings
            )
        layers = [Gemma3DecoderLayer(self, i) for i in range(self.num_layers)]
        norm = RMSNorm(self.hidden_size, self.eps, unit_offset=True)
        self.model = DecoderStack(self.vocab_size, self.hidden_size, layers, norm)
        self._build_head()

    @staticmethod
    def _rope(config: Mapping[str, Any], layer_type: str) -> dict:
        """The rope of ``layer_type`` as ``Gemma3TextConfig.convert_rope_params_to_dict`` builds it.

        ``rope_parameters[layer_type]`` (absent: default rope); old configs' ``rope_scaling``
        applies to the full layers; a missing ``rope_theta`` is ``rope_theta`` (1e6) for the
        full layers, ``rope_local_base_freq`` (1e4) for the sliding ones.
        """
        params = dict((config.get("rope_parameters") or {}).get(layer_type) or {"rope_type": "default"})
        if layer_type == "full_attention":
            scaling = dict(config.get("rope_scaling") or {})
            if "type" in scaling:
                scaling.setdefault("rope_type", scaling.pop("type"))
            params.update(scaling)
            params.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
        else:
            params.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
        params.setdefault("rope_type", "default")
        return params

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        scale = self._embed_scales.get((weight.dtype, weight.device))
        if scale is None:  # made once: a host-to-device copy per step would break CUDA graph capture
            scale = torch.tensor(self.hidden_size**0.5, dtype=weight.dtype, device=weight.device)
            self._embed_scales[(weight.dtype, weight.device)] = scale
        return self.lookup_embeddings(input_ids) * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:  # tanh(logits / cap) * cap, in place on the fresh logits (one pass less over the vocab)
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits
