"""Llama 4 text (``Llama4ForCausalLM``, model_type ``llama4_text``): iRoPE, as HF 5.24 runs it.

Also the language model of ``Llama4ForConditionalGeneration`` checkpoints (``text_config``;
the vision model is not loaded, see :func:`~hybridkv.engine.loading.weights.language_model_weight_name`).

* ``no_rope_layers[i] == 1`` means layer ``i`` *uses* RoPE (default: every
  ``no_rope_layer_interval``-th layer is NoPE). ``layer_types[i]`` picks the mask:
  ``chunked_attention`` (default for RoPE layers, chunk ``attention_chunk_size``,
  key k visible from query p iff ``k // C == p // C``, k <= p) or ``full_attention``
  (default for NoPE layers).
* RoPE pairs dims ``(2i, 2i+1)`` (HF multiplies complex numbers).
* ``use_qk_norm``: on RoPE layers only, q and k get a weightless L2 norm
  ``x * rsqrt(mean(x^2) + rms_norm_eps)`` *after* RoPE.
* ``attn_temperature_tuning``: on NoPE layers, ``q *= log1p(floor((p + 1) / floor_scale))
  * attn_scale + 1`` for the query at absolute position ``p``.
* MLP: dense ``intermediate_size_mlp`` unless ``i in moe_layers`` (default: every
  ``interleave_moe_layer_step``-th layer; ``moe_layers=[]`` = all dense). MoE =
  shared expert (``intermediate_size``) + routed experts: router logits ``x W^T``,
  top-k, score ``sigmoid(logit)``; the score scales the expert's *input*:
  ``expert_e(x * s_e)`` with ``gate_up_proj [E, h, 2I]`` split in halves (gate, up).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.layers.activation import activation
from hybridkv.engine.layers.decoder import DecoderLayer, DecoderStack, Rope, require
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.models.llama import GatedMLP, LlamaAttention
from hybridkv.engine.layers.rope import RotaryEmbedding, apply_interleaved, rope_parameters
from hybridkv.errors import InvalidConfigError

ATTN_SCALES = "llama4_attn_scales"  # the step tables' key of the NoPE layers' query scales

__all__ = ["Llama4ForCausalLM"]


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over the last dim (HF ``Llama4TextL2Norm``)."""
    if x.dtype == torch.float32:  # one op, same values
        return nn.functional.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(LlamaAttention):
    def __init__(self, model: "Llama4ForCausalLM", layer_idx: int) -> None:
        bias = bool(model.config.get("attention_bias", False))
        super().__init__(model, layer_idx, model.attention_type(layer_idx), qkv_bias=bias, o_bias=bias)
        cfg = model.config
        self.use_rope = bool(model.no_rope_layers[layer_idx])
        self.qk_norm = bool(cfg.get("use_qk_norm", True)) and self.use_rope
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))
        self.temperature_tuning = model.temperature_tuning and not self.use_rope

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qk, v = self.project_qk_v(x)  # [T, Hq + Hkv, D], [T, Hkv, D]
        if self.use_rope:
            qk = apply_interleaved(qk, rope["default"])
        if self.qk_norm:
            qk = _l2_norm(qk, self.eps)
        q, k = self.split_qk(qk)
        if self.temperature_tuning:
            q = (q * rope[ATTN_SCALES]).to(q.dtype)  # [T, Hq, D] * [T, 1, 1] (Llama4ForCausalLM.step_tables)
        return q, k, v


class Llama4Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * intermediate))  # [E, h, 2I]
        self.down_proj = nn.Parameter(torch.zeros(num_experts, intermediate, hidden))  # [E, I, h]
        self.act = activation(act)

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x [n, h] -> [n, h]."""
        gate, up = (x @ self.gate_up_proj[e]).chunk(2, dim=-1)
        return (up * self.act(gate)) @ self.down_proj[e]


class Llama4MoE(nn.Module):
    def __init__(self, model: "Llama4ForCausalLM") -> None:
        super().__init__()
        cfg = model.config
        hidden, act = model.hidden_size, cfg.get("hidden_act", "silu")
        intermediate = int(require(cfg, "intermediate_size"))
        self.num_experts = int(require(cfg, "num_local_experts"))
        self.top_k = int(cfg.get("num_experts_per_tok", 1))
        self.router = nn.Linear(hidden, self.num_experts, bias=False)
        self.experts = Llama4Experts(hidden, intermediate, self.num_experts, act)
        self.shared_expert = GatedMLP(hidden, intermediate, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        logits = self.router(x)  # [T, E]
        top_value, top_index = torch.topk(logits, self.top_k, dim=1)  # [T, k]
        scores = torch.sigmoid(top_value.float()).to(x.dtype)  # [T, k]
        out = self.shared_expert(x)
        for e in torch.unique(top_index).tolist():
            token, slot = torch.where(top_index == e)
            out.index_add_(0, token, self.experts.run(e, x[token] * scores[token, slot, None]))
        return out


def _decoder_layer(model: "Llama4ForCausalLM", layer_idx: int) -> DecoderLayer:
    """Llama 4's layer: HF names the MLP ``feed_forward``; MoE on ``moe_layers``, else dense."""
    cfg = model.config
    if layer_idx in model.moe_layers:
        ff: nn.Module = Llama4MoE(model)
    else:
        ff = GatedMLP(model.hidden_size, int(require(cfg, "intermediate_size_mlp")), cfg.get("hidden_act", "silu"))
    return DecoderLayer(model.hidden_size, model.eps, Llama4Attention(model, layer_idx), ff, mlp_name="feed_forward")


class Llama4ForCausalLM(CausalLM):
    family = "llama4"

    def __init__(self, config: Mapping[str, Any], label: str = "config") -> None:
        super().__init__(config, label)
        config = self.config
        n = self.num_layers
        self.eps = float(config.get("rms_norm_eps", 1e-5))
        interval = int(config.get("no_rope_layer_interval", 4))
        self.no_rope_layers = list(config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])
        if len(self.no_rope_layers) != n:
            raise InvalidConfigError(f"no_rope_layers has {len(self.no_rope_layers)} entries for {n} layers")
        step = int(config.get("interleave_moe_layer_step", 1))
        moe = config.get("moe_layers")
        self.moe_layers = set(moe if moe is not None else range(step - 1, n, step))
        self.supports_cuda_graphs = not self.moe_layers  # the experts are picked on the host
        self.rotaries["default"] = RotaryEmbedding(
            rope_parameters(config, 500000.0), self.head_dim, self.max_position_embeddings, interleaved=True
        )
        self.temperature_tuning = bool(config.get("attn_temperature_tuning", True))
        self.floor_scale = float(config.get("floor_scale", 8192))
        self.attn_scale = float(config.get("attn_scale", 0.1))
        layers = [_decoder_layer(self, i) for i in range(n)]
        self.model = DecoderStack(self.vocab_size, self.hidden_size, layers, RMSNorm(self.hidden_size, self.eps))
        self._build_head()

    def step_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotary's tables, and with temperature tuning the NoPE layers' query scales [T, 1, 1]:
        ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` (under :data:`ATTN_SCALES`)."""
        tables = super().step_tables(positions, dtype)
        if self.temperature_tuning:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            tables[ATTN_SCALES] = scales.view(-1, 1, 1)
        return tables
