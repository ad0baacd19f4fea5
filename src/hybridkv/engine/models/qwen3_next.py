"""Qwen3-Next (``Qwen3NextForCausalLM``), as HF transformers 5.24 runs it.

Layers mix two token mixers (``layer_types``, else every ``full_attention_interval``-th
layer, 4, is full attention; the planner reads this: :attr:`CausalLM.layout`):

* ``linear_attn``: Gated DeltaNet (:class:`~hybridkv.engine.layers.gated_deltanet.GatedDeltaNet`)
  with a per-sequence state in slots, driven by a :class:`StateMetadata`;
* ``self_attn``: *gated* full attention over the paged KV: ``q_proj`` gives per head
  ``[q (D) | gate (D)]``, q and k get a per-head RMSNorm, RoPE rotates only the first
  ``partial_rotary_factor * D`` dims (0.25), and the output is ``o_proj(attn * sigmoid(gate))``.

Every RMSNorm but the linear layers' gated one is zero-centred: ``x / rms(x) * (1 + w)``.
The MLP is a sparse MoE on layers ``i`` with ``(i + 1) % decoder_sparse_step == 0`` that are
not in ``mlp_only_layers`` (and ``num_experts > 0``), else a dense gated MLP. The MoE:
softmax over all experts (fp32), top-k, renormalised when ``norm_topk_prob``, plus a shared
expert scaled by ``sigmoid(shared_expert_gate(x))``. Experts are stored per expert
(``mlp.experts.{e}.gate_proj``), as the checkpoints and HF's ``save_pretrained`` write them.

A step runs :meth:`Qwen3NextForCausalLM.forward` with the AttentionMetadata of the full
layers and the :class:`StateMetadata` of the linear ones (same sequences, same order), or
a :class:`~hybridkv.engine.state.StepStates` when the linear layers are in several state
groups with their own slots (the engine's cache layout): each layer reads
``state.for_layer(layer_idx)``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hybridkv.engine.attention.layer import paged_attention
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import FULL
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.layers.decoder import DecoderStack, Rope, require
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.engine.layers.gated_deltanet import GatedDeltaNet, StateMetadata, StateShape
from hybridkv.engine.state import StepStates
from hybridkv.engine.layers.linear import FusedQKV, Linear
from hybridkv.engine.models.llama import GatedMLP
from hybridkv.engine.layers.rope import RotaryEmbedding, apply_rotate_half, rope_parameters
from hybridkv.errors import InvalidArgumentError, InvalidConfigError
from hybridkv.planner.architectures import LINEAR_KIND

__all__ = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "GatedAttention", "SparseMoeBlock"]

#: HF's default when neither rope_parameters nor the config says (Qwen3NextConfig.__post_init__)
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25


class GatedAttention(FusedQKV):
    """Qwen3-Next's full attention: per-head output gate, q/k norms, partial RoPE."""

    def __init__(self, model: "Qwen3NextForCausalLM", layer_idx: int) -> None:
        super().__init__()
        h, d = model.hidden_size, model.head_dim
        bias = bool(model.config.get("attention_bias", False))
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = model.num_heads, model.num_kv_heads, d
        self.rotary_dim = model.rotary_dim
        self.scale = d**-0.5
        self.q_proj = Linear(h, 2 * self.num_heads * d, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, model.eps, unit_offset=True)
        self.k_norm = RMSNorm(d, model.eps, unit_offset=True)
        self.init_fused_qkv()  # qkv_weight [(2 Hq + 2 Hkv) D, h] once fused

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        if rd == self.head_dim:
            return apply_rotate_half(x, cos, sin)
        return torch.cat([apply_rotate_half(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] ([N, hidden] with ``keep``); writes this step's K/V."""
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.project_qkv(x)  # [T, (2 Hq + 2 Hkv) D]
        qg = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
        gate = qg[..., d:]  # [T, Hq, D]
        k = qkv[:, 2 * hq * d : (2 * hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (2 * hq + hkv) * d :].view(t, hkv, d)
        cos, sin = rope["default"]
        q = self._rope(self.q_norm(qg[..., :d]), cos, sin)
        k = self._rope(self.k_norm(k), cos, sin)
        out = paged_attention(q, k, v, meta, self.layer_idx, FULL, self.scale, keep=keep)  # [T or N, Hq, D]
        if keep is not None:
            gate = gate.index_select(0, keep)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(out.shape[0], hq * d))


class _Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))


class SparseMoeBlock(nn.Module):
    """Top-k softmax-routed experts plus a sigmoid-gated shared expert (HF names)."""

    def __init__(self, model: "Qwen3NextForCausalLM", norm_topk_prob: bool) -> None:
        super().__init__()
        cfg, h = model.config, model.hidden_size
        act = cfg.get("hidden_act", "silu")
        self.num_experts = int(require(cfg, "num_experts"))
        self.top_k = int(require(cfg, "num_experts_per_tok"))
        self.norm_topk_prob = norm_topk_prob
        inter = int(require(cfg, "moe_intermediate_size"))
        self.gate = _Router(h, self.num_experts)
        self.experts = nn.ModuleList(GatedMLP(h, inter, act) for _ in range(self.num_experts))
        self.shared_expert = GatedMLP(h, int(require(cfg, "shared_expert_intermediate_size")), act)
        self.shared_expert_gate = Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        logits = nn.functional.linear(x, self.gate.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        top_value = top_value.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(top_index).tolist():
            token, slot = torch.where(top_index == e)
            y = self.experts[e](x.index_select(0, token))
            out.index_add_(0, token, y * top_value[token, slot, None])
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return out.add_(shared)


class Qwen3NextDecoderLayer(nn.Module):
    """``h + mixer(input_layernorm(h))``, then ``h + mlp(post_attention_layernorm(h))``;
    the mixer is ``linear_attn`` (Gated DeltaNet) or ``self_attn`` (gated full attention)."""

    def __init__(self, hidden: int, eps: float, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        self.add_module("linear_attn" if self.is_linear else "self_attn", mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        state: StateMetadata | StepStates | None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.is_linear:
            if state is None:
                raise InvalidArgumentError("a model with linear-attention layers needs the step's StateMetadata")
            a = self.linear_attn(x, state.for_layer(self.linear_attn.layer_idx), keep=keep)
        else:
            a = self.self_attn(x, positions, rope, meta, keep=keep)
        if keep is not None:
            h = h.index_select(0, keep)
        h = a.add_(h)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next: Gated DeltaNet and gated full-attention layers, MoE MLPs."""

    family = "qwen3_next"
    supports_cuda_graphs = False  # the experts are picked on the host (and state layers run eagerly)
    #: Qwen3.5 projects q|k|v, z, b and a with four linears (``in_proj_qkv`` ...)
    split_projections = False
    default_rope_theta = 10000.0
    ignored_weights = ("mtp.",)

    def __init__(self, config: Mapping[str, Any], label: str = "config") -> None:
        super().__init__(config, label)
        config = self.config
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        params = rope_parameters(config, self.default_rope_theta)
        factor = float(params.pop("partial_rotary_factor", config.get("partial_rotary_factor",
                                                                       DEFAULT_PARTIAL_ROTARY_FACTOR)))
        self.rotary_dim = int(self.head_dim * factor)
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise InvalidConfigError(f"partial_rotary_factor {factor} gives an odd or empty rotary dim")
        self.rotaries["default"] = RotaryEmbedding(params, self.rotary_dim, self.max_position_embeddings)
        #: the linear-attention layers, in order
        self.linear_layers: list[int] = [i for i, k in enumerate(self.layout.kinds) if k.kind == LINEAR_KIND]
        layers = [self._make_layer(i) for i in range(self.num_layers)]
        self.model = DecoderStack(self.vocab_size, self.hidden_size, layers,
                                  RMSNorm(self.hidden_size, self.eps, unit_offset=True))
        self._build_head()

    def _is_moe(self, i: int) -> bool:
        cfg = self.config
        sparse_step = int(cfg.get("decoder_sparse_step") or 1)
        return (
            i not in (cfg.get("mlp_only_layers") or [])
            and int(cfg.get("num_experts") or 0) > 0
            and (i + 1) % sparse_step == 0
        )

    def _make_mlp(self, i: int) -> nn.Module:
        if self._is_moe(i):
            return SparseMoeBlock(self, bool(self.config.get("norm_topk_prob", True)))
        return GatedMLP(self.hidden_size, require(self.config, "intermediate_size"),
                        self.config.get("hidden_act", "silu"))

    def _make_linear_attention(self, i: int) -> GatedDeltaNet:
        cfg = self.config
        return GatedDeltaNet(
            layer_idx=i,
            hidden=self.hidden_size,
            num_k_heads=int(require(cfg, "linear_num_key_heads")),
            num_v_heads=int(require(cfg, "linear_num_value_heads")),
            head_k_dim=int(require(cfg, "linear_key_head_dim")),
            head_v_dim=int(require(cfg, "linear_value_head_dim")),
            conv_kernel=int(require(cfg, "linear_conv_kernel_dim")),
            eps=self.eps,
            split_projections=self.split_projections,
        )

    def _make_layer(self, i: int) -> nn.Module:
        mixer = self._make_linear_attention(i) if i in self.linear_layers else GatedAttention(self, i)
        return Qwen3NextDecoderLayer(self.hidden_size, self.eps, mixer, self._make_mlp(i))

    def state_shape(self) -> StateShape:
        """The per-sequence state of every linear-attention layer (all alike)."""
        cfg = self.config
        hk, hv = int(require(cfg, "linear_num_key_heads")), int(require(cfg, "linear_num_value_heads"))
        dk, dv = int(require(cfg, "linear_key_head_dim")), int(require(cfg, "linear_value_head_dim"))
        return StateShape(2 * hk * dk + hv * dv, int(require(cfg, "linear_conv_kernel_dim")), hv, dk, dv)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        state: StateMetadata | StepStates | None = None,
    ) -> torch.Tensor:
        """input_ids / positions [T] -> final-norm hidden states [T, hidden] ([N, hidden] for
        ``meta.output_seqs``): ``meta`` for the full-attention layers, ``state`` for the linear ones."""
        keep = meta.output_rows()
        hidden = self.embed(input_ids)
        rope = {name: r.tables(positions, hidden.dtype) for name, r in self.rotaries.items()}
        *layers, last = self.model.layers
        for layer in layers:
            hidden = layer(hidden, positions, rope, meta, state)
        hidden = last(hidden, positions, rope, meta, state, keep=keep)
        return self.model.norm(hidden)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense): Qwen3-Next's layers with split linear-attention projections
    (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and a dense MLP on every
    layer. Its multimodal RoPE (``mrope_section``) rotates text tokens as plain RoPE (every
    section has the same position), so a text-only run is the rotary above.
    ``Qwen3_5ForConditionalGeneration`` checkpoints load their language model."""

    family = "qwen3_5"
    split_projections = True

    def _is_moe(self, i: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: Qwen3.5's split projections, a MoE (with shared expert) on every layer,
    top-k weights always renormalised (HF ``Qwen3VLMoeTextTopKRouter``)."""

    family = "qwen3_5_moe"
    split_projections = True

    def _make_mlp(self, i: int) -> nn.Module:
        return SparseMoeBlock(self, norm_topk_prob=True)
