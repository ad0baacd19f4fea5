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

from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.layers.norms import RMSNorm
from hybridkv.errors import InvalidConfigError

__all__ = ["DecoderLayer", "DecoderStack", "describe_layer", "Rope", "require"]

#: rope name -> the rotary's per-step tables ((cos, sin), or cis for interleaved rotaries)
Rope = dict[str, Any]


def require(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, or InvalidConfigError naming the missing key."""
    value = config.get(key)
    if value is None:
        raise InvalidConfigError(f"model config lacks required field {key!r}")
    return value


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
        # submodules through forward(): inference runs no hooks, and it skips __call__'s hook checks
        a = self.self_attn.forward(self.input_layernorm.forward(h), positions, rope, meta, keep=keep)  # [T or N, hidden]
        if keep is not None:  # only these rows go on (see CausalLM.forward)
            h = h.index_select(0, keep)
        h = self.attn_branch(a).add_(h)  # a fresh tensor: add in place (h + a, bit for bit)
        return self.mlp_branch(h).add_(h)

    def decode_parts(self) -> dict[str, Any] | None:
        """This layer for :class:`~hybridkv.engine.attention.cpu_stack.FusedDecode` (None: it cannot
        run fused). A subclass that changes :meth:`forward` or the branches describes itself."""
        cls = type(self)
        if cls.attn_branch is not DecoderLayer.attn_branch or cls.mlp_branch is not DecoderLayer.mlp_branch:
            return None
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
        # built on the meta device (the loader's case): no random init (there torch's normal_ takes a
        # path that imports torch._dynamo, seconds at start-up); elsewhere nn.Embedding's own
        weight = torch.empty(vocab, hidden)
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=weight) if weight.is_meta else nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


def describe_layer(layer: "DecoderLayer", ln2: RMSNorm, post_attn: RMSNorm | None,
                   post_ff: RMSNorm | None) -> dict[str, Any] | None:
    """A decoder layer's parts for the plan (None: it cannot run fused): its attention's and
    MLP's ``decode_parts()``, ``input_layernorm``, then ``ln2`` before the MLP, ``post_attn`` /
    ``post_ff`` on the branches' outputs (Gemma 3's sandwich norms; None: none); every norm an
    RMSNorm of one eps, and ``layer.forward`` :class:`DecoderLayer`'s."""
    if type(layer).forward is not DecoderLayer.forward:
        return None
    parts = [getattr(m, "decode_parts", None) for m in (layer.self_attn, layer.ffn)]
    attn, mlp = (describe() if describe is not None else None for describe in parts)
    norms = [n for n in (layer.input_layernorm, ln2, post_attn, post_ff) if n is not None]
    if attn is None or mlp is None or not all(isinstance(n, RMSNorm) for n in norms):
        return None
    eps = layer.input_layernorm.eps
    if any(n.eps != eps for n in norms) or attn["qk_eps"] not in (None, eps):
        return None
    scale = lambda n: None if n is None else n.scale()  # noqa: E731  (fp32 multipliers [hidden])
    return {**attn, **mlp, "hidden": layer.input_layernorm.weight.shape[0], "eps": float(eps),
            "ln1": layer.input_layernorm.scale(), "ln2": ln2.scale(), "post_attn": scale(post_attn),
            "post_ff": scale(post_ff)}
