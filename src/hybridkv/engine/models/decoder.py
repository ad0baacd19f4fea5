"""The decoder layer every family shares, and the helpers its parts use (a required config
field, the activations by HF's names).

Every family's decoder layer is a :class:`DecoderLayer` (HF's pre-norm block, the row
selection of the last layer, the residual adds); a family changes only its attention, its
MLP (and the attribute name HF gives it) and, for Gemma 3's sandwich norms, the two
residual branches. :class:`DecoderStack` is HF's ``model.`` (embeddings, layers, final
norm); :class:`~hybridkv.engine.models.base.CausalLM` runs it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hybridkv.engine.attention import AttentionMetadata
from hybridkv.engine.models.norms import RMSNorm
from hybridkv.errors import InvalidConfigError

__all__ = ["DecoderLayer", "DecoderStack", "Rope", "require", "activation", "activation_kernel"]

#: rope name -> the rotary's per-step tables ((cos, sin), or cis for interleaved rotaries)
Rope = dict[str, Any]


def require(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, or InvalidConfigError naming the missing key."""
    value = config.get(key)
    if value is None:
        raise InvalidConfigError(f"model config lacks required field {key!r}")
    return value


def activation(name: str):
    """The activation function HF's ``ACT2FN[name]`` names."""
    if name in ("silu", "swish"):
        return nn.functional.silu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh"):
        return lambda x: nn.functional.gelu(x, approximate="tanh")
    if name == "gelu":
        return nn.functional.gelu
    if name == "relu":
        return nn.functional.relu
    raise InvalidConfigError(f"unsupported activation {name!r}")


def activation_kernel(name: str) -> str | None:
    """The fused C kernel's name for :func:`activation` ``name`` (:data:`hybridkv.engine.cpu_ops.ACTIVATIONS`),
    None where it has none."""
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh"):
        return "gelu_tanh"
    return None


class DecoderLayer(nn.Module):
    """HF's decoder layer: ``h + attn(input_layernorm(h))``, then ``h + mlp(post_attention_layernorm(h))``.

    Submodule names are HF's: ``self_attn``, ``input_layernorm``,
    ``post_attention_layernorm`` and the MLP under ``mlp_name`` (``"mlp"``; Llama 4
    calls it ``"feed_forward"``). Subclasses change the residual branches through
    :meth:`attn_branch` / :meth:`mlp_branch` (Gemma 3's sandwich norms).
    """

    def __init__(
        self,
        hidden: int,
        eps: float,
        self_attn: nn.Module,
        mlp: nn.Module,
        mlp_name: str = "mlp",
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.add_module(mlp_name, mlp)
        self.mlp_name = mlp_name
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=unit_offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=unit_offset)

    @property
    def ffn(self) -> nn.Module:
        """The MLP, whatever HF names it."""
        return self._modules[self.mlp_name]

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; with ``keep`` [N] (the last layer), [N, hidden] for those rows."""
        # submodules through forward(): inference runs no hooks, and a call costs ~1 us less
        a = self.self_attn.forward(self.input_layernorm.forward(h), positions, rope, meta, keep=keep)  # [T or N, hidden]
        if keep is not None:  # only these rows go on (see CausalLM.forward)
            h = h.index_select(0, keep)
        h = self.attn_branch(a).add_(h)  # a fresh tensor: add in place (h + a, bit for bit)
        return self.mlp_branch(h).add_(h)

    def decode_parts(self) -> dict[str, Any] | None:
        """This layer for :class:`~hybridkv.engine.models.fused_decode.FusedDecode` (None: it cannot
        run fused). A subclass that changes :meth:`forward` or the branches describes itself."""
        cls = type(self)
        if cls.attn_branch is not DecoderLayer.attn_branch or cls.mlp_branch is not DecoderLayer.mlp_branch:
            return None
        from hybridkv.engine.models.fused_decode import describe_layer

        return describe_layer(self, self.post_attention_layernorm, None, None)

    def attn_branch(self, a: torch.Tensor) -> torch.Tensor:
        """What the attention adds to the residual stream (its output); must return a fresh tensor."""
        return a

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        """What the MLP adds to the residual stream; must return a fresh tensor."""
        return self.ffn.forward(self.post_attention_layernorm.forward(h))


class DecoderStack(nn.Module):
    """HF's ``model.``: ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(self, vocab: int, hidden: int, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
