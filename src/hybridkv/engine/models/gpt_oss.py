"""GPT-OSS (``GptOssForCausalLM``), as HF 5.24 runs it (eager attention).

* ``layer_types`` alternate sliding (even layers) / full (odd) by default,
  ``sliding_window`` 128;
* attention has biases on q/k/v/o and learned per-head *sinks*: a logit per head
  that joins the softmax denominator and is dropped afterwards;
* rope is yarn by default (rotate-half pairs, cos/sin scaled by the yarn factor);
* the MLP is a MoE: router ``logits = x W^T + b``, top-k, softmax over the top-k
  logits; expert ``e``: ``gu = x @ gate_up_proj[e] + bias`` with gate / up
  *interleaved* (``gu[..., ::2]``, ``gu[..., 1::2]``), ``gate`` clamped above at
  ``limit``, ``up`` clamped to ``[-limit, limit]``,
  ``out = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + bias``.

MXFP4-quantized checkpoints (``*_blocks`` / ``*_scales``) are not supported: their
tensors are reported as unknown by the loader.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hybridkv.engine.attention.types import AttentionType
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.layers.decoder import DecoderLayer, DecoderStack, require
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.models.llama import LlamaAttention
from hybridkv.engine.layers.rope import RotaryEmbedding, rope_parameters

__all__ = ["GptOssForCausalLM"]

_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}


class GptOssAttention(LlamaAttention):
    def __init__(self, model: CausalLM, layer_idx: int, attn_type: AttentionType) -> None:
        bias = bool(model.config.get("attention_bias", True))
        super().__init__(model, layer_idx, attn_type, qkv_bias=bias, o_bias=bias)
        self.sinks = nn.Parameter(torch.zeros(model.num_heads))  # [Hq]


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts))


class GptOssExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * intermediate))  # [E, h, 2I]
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate))  # [E, 2I]
        self.down_proj = nn.Parameter(torch.zeros(num_experts, intermediate, hidden))  # [E, I, h]
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden))  # [E, h]


class GptOssMoE(nn.Module):
    """Top-k softmax-routed experts with the clamped, biased swiglu."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        cfg = model.config
        self.num_experts = int(require(cfg, "num_local_experts"))
        self.top_k = int(cfg.get("num_experts_per_tok", 4))
        self.alpha = float(cfg.get("swiglu_alpha", 1.702))
        self.limit = float(cfg.get("swiglu_limit", 7.0))
        self.router = GptOssRouter(model.hidden_size, self.num_experts)
        self.experts = GptOssExperts(model.hidden_size, int(require(cfg, "intermediate_size")), self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        logits = nn.functional.linear(x, self.router.weight, self.router.bias)  # [T, E]
        top_value, top_index = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_value, dim=1, dtype=top_value.dtype)  # [T, k]
        out = torch.zeros_like(x)
        ex = self.experts
        for e in torch.unique(top_index).tolist():
            token, slot = torch.where(top_index == e)
            gate_up = x[token] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]  # [n, 2I]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            y = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ ex.down_proj[e] + ex.down_proj_bias[e]
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


class GptOssForCausalLM(CausalLM):
    family = "gpt_oss"
    supports_cuda_graphs = False  # the experts are picked on the host

    def __init__(self, config: Mapping[str, Any], label: str = "config") -> None:
        super().__init__(config, label)
        config = self.config
        self.eps = float(config.get("rms_norm_eps", 1e-5))
        params = config.get("rope_parameters") or dict(_DEFAULT_ROPE)
        self.rotaries["default"] = RotaryEmbedding(
            rope_parameters({"rope_parameters": params}, 150000.0), self.head_dim, self.max_position_embeddings
        )
        layers = [
            DecoderLayer(self.hidden_size, self.eps, GptOssAttention(self, i, self._types[i]), GptOssMoE(self))
            for i in range(self.num_layers)
        ]
        self.model = DecoderStack(self.vocab_size, self.hidden_size, layers, RMSNorm(self.hidden_size, self.eps))
        self._build_head()
