"""Llama (``LlamaForCausalLM``) and the pieces the other families reuse.

Decoder layer (HF ``modeling_llama``)::

    h = h + o_proj(attn(rope(q_proj(norm1(h))), rope(k_proj(..)), v_proj(..)))
    h = h + down_proj(act(gate_proj(norm2(h))) * up_proj(norm2(h)))

All layers are full attention. Mistral, Qwen2 and Qwen3 subclass this with sliding layers
(each layer's kind comes from the planner: :attr:`CausalLM.layout`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hybridkv.engine.attention.layer import paged_attention
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import AttentionType
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.layers.activation import GatedActivation
from hybridkv.engine.layers.decoder import DecoderLayer, DecoderStack, Rope, require
from hybridkv.engine.layers.linear import FusedQKV, Linear, PackedWeight, fuse_linears, linear
from hybridkv.engine.layers.norms import RMSNorm, rms_norm_heads, stacked_scales
from hybridkv.engine.layers.rope import RotaryEmbedding, RotateHalf, rope_parameters

__all__ = ["QKNormAttention", "GatedMLP", "LlamaAttention", "LlamaForCausalLM"]


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; after :meth:`fuse`, gate and up are one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gated_act = GatedActivation(act, intermediate)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2I, h] once fused
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.gate_up_packed: PackedWeight | None = None

    def fuse(self) -> None:
        self.gate_up_weight, self.gate_up_bias = fuse_linears([self.gate_proj, self.up_proj])

    def prepack(self, enable: bool = True) -> None:
        self.gate_up_packed = PackedWeight.make(self.gate_up_weight) if enable else None

    def quant_targets(self) -> list[tuple[str, torch.Tensor]]:
        return [] if self.gate_up_weight is None else [("gate_up_packed", self.gate_up_weight)]

    def quant_parts(self) -> dict[str, tuple[str, ...]]:
        """The linears the fused gate / up slot holds, in row order."""
        return {"gate_up_packed": ("gate_proj", "up_proj")}

    def decode_parts(self) -> dict[str, Any] | None:
        """What :class:`~hybridkv.engine.attention.cpu_stack.FusedDecode` needs: gate/up and down
        quantized, no biases, an activation with a C kernel (else None)."""
        gate_up, down = self.gate_up_packed, self.down_proj.packed
        if (self.gate_up_weight is None or self.gate_up_bias is not None or self.down_proj.bias is not None
                or not getattr(gate_up, "quantized", False) or not getattr(down, "quantized", False)
                or self.gated_act.kernel is None or gate_up.kernel_fields() is None or down.kernel_fields() is None):
            return None
        return {"gate_up": gate_up, "down": down, "act": self.gated_act.kernel, "intermediate": self.intermediate}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(self.gated_act.act(self.gate_proj(x)) * self.up_proj(x))
        packed = self.gate_up_packed
        if packed is not None and packed.quantized:  # one call less on the quantized decode path
            gate_up = packed.linear(x, self.gate_up_bias)  # [T, 2I]
        else:
            gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, packed)
        return self.down_proj.forward(self.gated_act.forward(gate_up))


class LlamaAttention(FusedQKV):
    """q/k/v/o projections + rotate-half RoPE + paged attention of one layer."""

    def __init__(
        self,
        model: CausalLM,
        layer_idx: int,
        attn_type: AttentionType,
        qkv_bias: bool = False,
        o_bias: bool = False,
        rope_name: str = "default",
    ) -> None:
        super().__init__()
        h, d = model.hidden_size, model.head_dim
        self.layer_idx = layer_idx
        self.attn_type = attn_type
        self.num_heads, self.num_kv_heads, self.head_dim = model.num_heads, model.num_kv_heads, d
        self.scale = d**-0.5
        self.rope_name = rope_name
        self.q_proj = Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=o_bias)
        self.init_fused_qkv()  # qkv_weight [(Hq + 2 Hkv) D, h] once fused
        self.sinks: torch.Tensor | None = None  # [Hq] learned softmax sinks (GPT-OSS sets a parameter)
        self.rotate = RotateHalf()  # rotate-half RoPE of q and k (torch's ops or the C kernel)

    def decode_parts(self, qk_norm: tuple[torch.Tensor, float] | None = None) -> dict[str, Any] | None:
        """What :class:`~hybridkv.engine.attention.cpu_stack.FusedDecode` needs of this attention
        (None when it cannot run fused): q/k/v and o quantized, no biases or sinks, and this
        class's :meth:`qkv` (rotate-half RoPE; ``qk_norm``: the per-head multipliers [Hq + Hkv, D]
        and eps of a subclass's q/k norms)."""
        if type(self).qkv is not LlamaAttention.qkv and qk_norm is None:
            return None  # a subclass's own q/k path: it describes itself
        qkv, o = self.qkv_packed, self.o_proj.packed
        if (self.qkv_weight is None or self.qkv_bias is not None or self.o_proj.bias is not None
                or self.sinks is not None or not getattr(qkv, "quantized", False)
                or not getattr(o, "quantized", False) or qkv.kernel_fields() is None or o.kernel_fields() is None):
            return None
        return {
            "layer": self.layer_idx, "attn": self.attn_type, "rope": self.rope_name, "scale": float(self.scale),
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "qkv": qkv, "o": o, "qk_norm": None if qk_norm is None else qk_norm[0],
            "qk_eps": None if qk_norm is None else qk_norm[1],
        }

    def project_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, Hq + 2 Hkv, D]: the q heads, then k, then v (one matmul once fused)."""
        return self.project_qkv(x).view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k / v [T, Hkv, D] (views of one projection)."""
        qkv = self.project_heads(x)
        hq, hkv = self.num_heads, self.num_kv_heads
        return qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]

    def project_qk_v(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> qk [T, Hq + Hkv, D] (rope / norm them together), v [T, Hkv, D]."""
        qkv = self.project_heads(x)
        split = self.num_heads + self.num_kv_heads
        return qkv[:, :split], qkv[:, split:]

    def split_qk(self, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, Hq + Hkv, D] -> q [T, Hq, D], k [T, Hkv, D]."""
        return qk[:, : self.num_heads], qk[:, self.num_heads :]

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] ([N, hidden] for the rows ``keep`` names); writes this step's K/V."""
        q, k, v = self.qkv(x, positions, rope, meta)
        out = paged_attention(q, k, v, meta, self.layer_idx, self.attn_type, self.scale, sinks=self.sinks, keep=keep)
        return self.o_proj.forward(out.reshape(out.shape[0], self.num_heads * self.head_dim))  # out: [T or N, Hq, D]

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k / v [T, Hkv, D] as attention reads them: rotate-half RoPE on q and k.

        Families with other norms / rotaries / query scaling override this.
        """
        qk, v = self.project_qk_v(x)
        cos, sin = rope[self.rope_name]
        q, k = self.split_qk(self.rotate.forward(qk, cos, sin))
        return q, k, v


class QKNormAttention(LlamaAttention):
    """Llama's attention with per-head RMSNorms ``q_norm`` / ``k_norm`` (weights of size ``head_dim``)
    on q and k *before* RoPE: ``rope(q_norm(q_proj(x).view(T, Hq, D)))`` (Qwen3; Gemma 3 with
    ``unit_offset`` norms)."""

    def __init__(self, model: "LlamaForCausalLM", layer_idx: int, attn_type: AttentionType, *, qkv_bias: bool,
                 o_bias: bool, rope_name: str = "default", unit_offset: bool = False) -> None:
        super().__init__(model, layer_idx, attn_type, qkv_bias=qkv_bias, o_bias=o_bias, rope_name=rope_name)
        self.q_norm = RMSNorm(model.head_dim, model.eps, unit_offset=unit_offset)
        self.k_norm = RMSNorm(model.head_dim, model.eps, unit_offset=unit_offset)
        self._qk_norm: dict = {}  # q_norm's and k_norm's multipliers stacked per head (rms_norm_heads)

    def decode_parts(self, qk_norm: tuple[torch.Tensor, float] | None = None) -> dict[str, Any] | None:
        """:meth:`LlamaAttention.decode_parts` with q_norm's and k_norm's multipliers per head, as
        :func:`~hybridkv.engine.layers.norms.rms_norm_heads` applies them to fp32 rows (one eps);
        None when a subclass changed :meth:`qkv`."""
        if type(self).qkv is not QKNormAttention.qkv or self.q_norm.eps != self.k_norm.eps:
            return None
        scale = stacked_scales(((self.q_norm, self.num_heads), (self.k_norm, self.num_kv_heads)))  # [Hq + Hkv, D]
        return LlamaAttention.decode_parts(self, (scale, self.q_norm.eps))

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qk, v = self.project_qk_v(x)  # [T, Hq + Hkv, D], [T, Hkv, D]
        qk = rms_norm_heads(qk, ((self.q_norm, self.num_heads), (self.k_norm, self.num_kv_heads)), self._qk_norm)
        cos, sin = rope[self.rope_name]
        q, k = self.split_qk(self.rotate.forward(qk, cos, sin))
        return q, k, v


class LlamaForCausalLM(CausalLM):
    """Llama 2 / 3 / 3.1 (rope default, linear or llama3). All layers full attention."""

    family = "llama"
    default_rope_theta = 10000.0
    qkv_bias_default = False

    def __init__(self, config: Mapping[str, Any], label: str = "config") -> None:
        super().__init__(config, label)
        config = self.config
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.rotaries["default"] = RotaryEmbedding(
            rope_parameters(config, self.default_rope_theta), self.head_dim, self.max_position_embeddings
        )
        layers = [self._make_layer(i) for i in range(self.num_layers)]
        self.model = DecoderStack(self.vocab_size, self.hidden_size, layers, RMSNorm(self.hidden_size, self.eps))
        self._build_head()

    def _qkv_bias(self) -> tuple[bool, bool]:
        bias = bool(self.config.get("attention_bias", self.qkv_bias_default))
        return bias, bias

    def _make_attention(self, i: int) -> LlamaAttention:
        qkv_bias, o_bias = self._qkv_bias()
        return LlamaAttention(self, i, self.attention_type(i), qkv_bias=qkv_bias, o_bias=o_bias)

    def _make_layer(self, i: int) -> nn.Module:
        attn = self._make_attention(i)
        mlp = GatedMLP(
            self.hidden_size,
            require(self.config, "intermediate_size"),
            self.config.get("hidden_act", "silu"),
            bias=bool(self.config.get("mlp_bias", False)),
        )
        return DecoderLayer(self.hidden_size, self.eps, attn, mlp)
