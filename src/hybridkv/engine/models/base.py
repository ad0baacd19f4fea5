"""What every model family shares: config access, loading, the decoder loop, specs.

A model is an ``nn.Module`` whose parameter names are the HF checkpoint names
(``model.layers.3.self_attn.q_proj.weight``), so weights load by name. ``forward``
runs a flat varlen batch (``T`` tokens of several sequences) through the decoder,
each attention layer writing / reading the paged KV storage named by the
:class:`~hybridkv.engine.attention.AttentionMetadata`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from hybridkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from hybridkv.engine.attention import AttentionMetadata, AttentionType
from hybridkv.engine.kv_storage import torch_dtype
from hybridkv.engine.models.linear import Linear
from hybridkv.engine.models.rope import RotaryEmbedding
from hybridkv.engine.models.weights import load_weights, read_config
from hybridkv.errors import InvalidConfigError

__all__ = ["CausalLM", "require", "activation"]


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


class CausalLM(nn.Module):
    """Base of the model families. Subclasses build ``self.model`` and ``self.lm_head``.

    ``self.model`` holds ``embed_tokens``, ``layers`` (each ``layer(h, positions,
    rope, meta)``) and ``norm``; ``self.rotaries`` maps a rope name to its table.
    """

    #: HF ``architectures[0]`` values and ``model_type`` values this class loads
    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.hidden_size: int = require(config, "hidden_size")
        self.vocab_size: int = require(config, "vocab_size")
        self.num_layers: int = require(config, "num_hidden_layers")
        self.num_heads: int = require(config, "num_attention_heads")
        self.num_kv_heads: int = config.get("num_key_value_heads") or self.num_heads
        self.head_dim: int = config.get("head_dim") or self.hidden_size // self.num_heads
        self.max_position_embeddings: int = config.get("max_position_embeddings") or 2048
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        if self.num_heads % self.num_kv_heads:
            raise InvalidConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        self.rotaries: dict[str, RotaryEmbedding] = {}
        self.model: nn.Module
        self.lm_head: nn.Linear

    # ---------------------------------------------------------------- building
    def _build_head(self) -> None:
        """``lm_head``, tied to ``model.embed_tokens`` when the config says so."""
        self.lm_head = Linear(self.hidden_size, self.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        prepack: bool = True,
    ) -> "CausalLM":
        """Build from ``model_dir/config.json`` and load its safetensors by HF name."""
        return cls.from_config(read_config(model_dir), model_dir, dtype=dtype, device=device, prepack=prepack)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        model_dir: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        prepack: bool = True,
    ) -> "CausalLM":
        """Build, load the weights, fuse q/k/v and gate/up; ``prepack``: see :meth:`prepack_weights`."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device).to(torch_dtype(dtype))
        if model.tie_word_embeddings:  # to_empty() breaks the tie
            model.lm_head.weight = model.model.embed_tokens.weight
        model._init_buffers()
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.tie_word_embeddings else {}
        load_weights(model, model_dir, tied=tied)
        model.fuse_weights()
        model.prepack_weights(prepack)
        return model.eval().requires_grad_(False)

    def _init_buffers(self) -> None:
        """Fill non-checkpoint tensors after ``to_empty`` (none by default)."""

    def fuse_weights(self) -> None:
        """Concatenate the weights that run on the same input (q/k/v, gate/up) into one matrix.

        Every submodule with a ``fuse()`` method does it; the original parameters become
        views of the fused matrix, so names, ``state_dict`` and memory stay as loaded.
        Call it after the weights are loaded and the model is on its device (moving the
        model afterwards keeps it correct but unshares the views).
        """
        for module in self.modules():
            if module is not self and callable(getattr(module, "fuse", None)):
                module.fuse()

    def prepack_weights(self, enable: bool = True) -> None:
        """Give every linear a oneDNN-prepacked copy of its weight (CPU fp32 only; else a no-op).

        See :mod:`hybridkv.engine.models.linear`: faster matmuls for one more copy of
        the linear weights in memory. ``enable=False`` drops the copies (plain
        ``F.linear``). Call it again after changing the weights.
        """
        for module in self.modules():
            if module is not self and callable(getattr(module, "prepack", None)):
                module.prepack(enable)

    # ---------------------------------------------------------------- running
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids / positions [T] -> final-norm hidden states [T, hidden].

        With ``meta.output_seqs`` set, [N, hidden] for the last token of each of those
        sequences: every layer still computes and stores K/V for all T tokens, but the
        last layer's attention queries, MLP and everything after run on these rows
        only (in a prefill step, nearly a whole layer's work skipped).
        """
        keep = meta.output_rows()  # [N] or None
        hidden = self.embed(input_ids)
        rope = {name: r.tables(positions, hidden.dtype) for name, r in self.rotaries.items()}  # once per step
        layers = self.model.layers
        for layer in layers[:-1]:
            hidden = layer(hidden, positions, rope, meta)
        hidden = layers[-1](hidden, positions, rope, meta, keep=keep)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]."""
        return self.lm_head(hidden)

    # ------------------------------------------------------ what the KV needs
    def attention_type(self, layer_idx: int) -> AttentionType:
        """The attention type of ``layer_idx``; subclasses override."""
        raise NotImplementedError

    def layer_attention_types(self) -> list[tuple[str, int | None]]:
        """Per layer ``("full", None)``, ``("sliding", W)`` or ``("chunked", C)``."""
        return [self.attention_type(i).as_tuple() for i in range(self.num_layers)]

    def kv_cache_specs(self, block_size: int, dtype: str = "bfloat16") -> list[KVCacheSpec]:
        """One core KV cache spec per layer."""
        specs: list[KVCacheSpec] = []
        common = dict(block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=dtype)
        for i in range(self.num_layers):
            attn = self.attention_type(i)
            if attn.kind == "sliding":
                specs.append(SlidingWindowSpec(sliding_window=attn.size, **common))
            elif attn.kind == "chunked":
                specs.append(ChunkedLocalAttentionSpec(attention_chunk_size=attn.size, **common))
            else:
                specs.append(FullAttentionSpec(**common))
        return specs
