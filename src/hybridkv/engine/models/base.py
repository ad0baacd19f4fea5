"""What every model family shares: loading, the decoder loop, specs.

A model is an ``nn.Module`` whose parameter names are the HF checkpoint names
(``model.layers.3.self_attn.q_proj.weight``), so weights load by name. ``forward``
runs a flat varlen batch (``T`` tokens of several sequences) through the decoder,
each attention layer writing / reading the paged KV storage named by the
:class:`~hybridkv.engine.attention.reference.AttentionMetadata`.

Every family's decoder layer is a
:class:`~hybridkv.engine.layers.decoder.DecoderLayer` (its own module), run here in order.

The config a model runs with and each layer's attention kind come from the planner
(:func:`~hybridkv.planner.architectures.language_model_config`,
:func:`~hybridkv.planner.architectures.model_layers`): one reading of ``config.json``
for the plan and the engine, with transformers' defaults for absent keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import nn

from hybridkv.checkpoint.config import as_model_source, read_model_config
from hybridkv.checkpoint.installed import ModelSource
from hybridkv.core.specs import KVCacheSpec
from hybridkv.engine import cpu_ops
from hybridkv.engine.layers.custom_op import CustomOp
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import AttentionType
from hybridkv.engine.kv_storage import torch_dtype
from hybridkv.engine.layers.decoder import require
from hybridkv.engine.layers.linear import Linear, PackedWeight
from hybridkv.engine.layers.rope import RotaryEmbedding
from hybridkv.engine.loading.weights import (
    checkpoint_tensors,
    eos_token_ids,
    language_model_weight_name,
    load_weights,
)
from hybridkv.errors import InvalidConfigError
from hybridkv.planner.architectures import ModelLayers, family_named, language_model_config, model_layers
from hybridkv.planner.hf_defaults import DEFAULT_MAX_POSITION_EMBEDDINGS

__all__ = ["CausalLM"]


def _ignoring(prefixes: tuple[str, ...], rename: Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    """``rename`` (or the identity) that also drops the names starting with ``prefixes``."""

    def renamed(name: str) -> str | None:
        if name.startswith(prefixes):
            return None
        return rename(name) if rename is not None else name

    return renamed


class CausalLM(nn.Module):
    """Base of the model families. Subclasses build ``self.model`` and ``self.lm_head``.

    ``self.model`` holds ``embed_tokens``, ``layers`` (each ``layer(h, positions,
    rope, meta)``) and ``norm``; ``self.rotaries`` maps a rope name to its table.
    """

    #: the planner family (:data:`~hybridkv.planner.architectures.FAMILIES`) whose checkpoints this
    #: class loads: its ``architectures`` / ``model_types`` select the class, its layer rule and
    #: config defaults are the ones this model runs with
    family: ClassVar[str] = ""
    #: HF ``architectures`` and ``model_type`` values this class loads: its family's
    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    #: name prefixes of checkpoint tensors the model does not use and the loader skips
    #: (Qwen3-Next's multi-token-prediction head ``mtp.``, which transformers skips too)
    ignored_weights: ClassVar[tuple[str, ...]] = ()
    #: whether a decode forward can be captured as a CUDA graph (no host-side control flow:
    #: a mixture of experts that picks its experts with ``.tolist()`` cannot)
    supports_cuda_graphs: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.family:
            family = family_named(cls.family)
            cls.architectures, cls.model_types = family.architectures, family.model_types

    def __init__(self, config: Mapping[str, Any], label: str = "config") -> None:
        super().__init__()
        #: the language model's keys, absent ones filled with transformers' defaults (multimodal
        #: configs: the keys of ``text_config``); see :func:`~hybridkv.planner.language_model_config`
        #: the planner's reading of the attention layers: kinds, KV heads, head size (read from the
        #: config as given, so that its errors name a multimodal file's keys: ``text_config.x``)
        self.layout: ModelLayers = model_layers(config, family=self.family, label=label, dtype="float32")
        self.config = language_model_config(config, family=self.family, label=label)
        config = self.config
        self.hidden_size: int = require(config, "hidden_size")
        self.vocab_size: int = require(config, "vocab_size")
        self.num_layers: int = self.layout.num_layers
        self.num_heads: int = require(config, "num_attention_heads")
        self.num_kv_heads: int = self.layout.num_kv_heads
        self.head_dim: int = self.layout.head_dim
        self.max_position_embeddings: int = config.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        if self.num_heads % self.num_kv_heads:
            raise InvalidConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        #: per layer, what :meth:`attention_type` returns
        self._types: list[AttentionType] = [AttentionType(k.kind, k.size) for k in self.layout.kinds]
        #: the ids that end generation unless a request asks ``ignore_eos`` (see :func:`eos_token_ids`;
        #: from_pretrained / from_config add generation_config.json's)
        self.eos_token_ids: tuple[int, ...] = eos_token_ids(self.config)
        self.rotaries: dict[str, RotaryEmbedding] = {}
        #: where the weights came from (set by :meth:`from_config`; None for a model built bare)
        self.source: ModelSource | None = None
        #: weight-only quantization in force (:meth:`quantize_weights`): None, "int8" or "int4"
        self.quantization: str | None = None
        self.embed_quant = None  # the quantized embedding rows, once quantized
        self.fused_decode = None  # FusedDecode: a quantized decode step's layers in one C call
        self.cpu_kernels = False  # the fused C kernels in use (use_cpu_kernels)
        self.embed_dtype: torch.dtype | None = None  # the dtype its rows come out in
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
        source: str | Path | ModelSource,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        prepack: bool = True,
    ) -> "CausalLM":
        """Build from ``source``'s config (``config.json`` or GGUF metadata) and load its weights by HF name."""
        source = as_model_source(source)
        return cls.from_config(read_model_config(source), source, dtype=dtype, device=device, prepack=prepack)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        source: str | Path | ModelSource,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        prepack: bool = True,
        quantization: str | None = None,
    ) -> "CausalLM":
        """Build, load the weights of ``source`` (a model directory, a .gguf file, an installed
        model's name), fuse q/k/v and gate/up; ``prepack``: see :meth:`prepack_weights`;
        ``quantization``: :meth:`quantize_weights` (then no prepacking); ``"gguf"``: a GGUF file's
        quantized blocks kept as stored (:mod:`~hybridkv.engine.loading.gguf_native`). A GGUF model in another
        form than fp32 comes from, or goes to, the final-form cache (:mod:`~hybridkv.engine.loading.final_weights`).

        A multimodal checkpoint (``text_config`` in ``config``) loads its language model only:
        see :func:`~hybridkv.engine.loading.weights.language_model_weight_name`.
        """
        source = as_model_source(source)
        label = source.config_label
        multimodal = config.get("text_config") is not None
        with torch.device("meta"):
            model = cls(config, label=label)
        config = model.config  # the language model's keys
        # a bad generation_config.json fails before the load; a GGUF file's ids are in its config
        eos = eos_token_ids(config, source.path if source.kind == "dir" else None)
        model = model.to_empty(device=device).to(torch_dtype(dtype))
        if model.tie_word_embeddings:  # to_empty() breaks the tie
            model.lm_head.weight = model.model.embed_tokens.weight
        model._init_buffers()
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.tie_word_embeddings else {}
        rename = language_model_weight_name if multimodal else None
        if cls.ignored_weights:
            rename = _ignoring(cls.ignored_weights, rename)
        skip = (lambda name: rename(name) is None) if rename is not None else None
        from hybridkv.engine.loading import final_weights

        final = final_weights.final_cache_for(source, model.model.embed_tokens.weight.dtype, quantization)
        if quantization == "gguf":  # the file's blocks as stored: no cache, nothing dequantized whole
            if source.kind != "gguf":
                raise InvalidConfigError(f"quantization gguf needs a GGUF checkpoint, not {source.path}")
            from hybridkv.engine.loading.gguf_native import load_native

            load_native(model, source.path, config, label=source.name or source.path.name, tied=tied, rename=rename)
        elif final is None or not final.exists() or not final_weights.load_final(model, final, quantization):
            tensors = checkpoint_tensors(source, config, skip=skip, use_cache=final is None)
            load_weights(model, tensors, label=str(source.path), tied=tied, rename=rename)
            model.fuse_weights()
            if quantization is not None:
                model.quantize_weights(quantization)
            if final is not None:
                final_weights.save_final(model, final)
        if quantization is None:
            model.prepack_weights(prepack)
        elif torch.device(device).type == "cpu":
            model.use_cpu_kernels(True)
        model.eos_token_ids = eos
        model.source = source
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
        """Give every linear prepacked copies of its weight (CPU fp32 only; else a no-op).

        See :mod:`hybridkv.engine.layers.linear`: faster matmuls (a transposed copy for
        decode-sized inputs, a oneDNN one for prefill) for two more copies of the linear
        weights in memory. ``enable=False`` drops the copies (plain ``F.linear``). Call
        it again after changing the weights.

        A tied output projection gets no copy: the one ``[vocab, hidden]`` matrix it shares
        with the embedding is re-laid out once as ``[hidden, vocab]`` (the embedding looks up
        its rows as a strided view), which is the transposed copy's layout: a large vocabulary's
        matrix is held once instead of three times, and the projection runs on it as fast as on
        a copy (faster than ``F.linear`` on the row-major matrix).
        """
        head = self.lm_head
        tied = self.tie_word_embeddings and head.weight is self.model.embed_tokens.weight
        for module in self.modules():
            if module is not self and module is not head and callable(getattr(module, "prepack", None)):
                module.prepack(enable)
        if not tied:
            head.prepack(enable)
            return
        weight = head.weight
        head.packed = None
        if not enable or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return
        if weight.is_contiguous():  # [V, H] row-major: lay it out once as [H, V] (the embedding keeps a view)
            with torch.no_grad():
                weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
            self.model.embed_tokens.weight = weight
            head.weight = weight
        head.packed = PackedWeight(weight, onednn=False)  # its transposed copy is the storage itself

    def quantize_weights(self, mode: str, compute_dtype: torch.dtype | None = None) -> None:
        """Weight-only quantization (int8 / int4) of every matrix the forward multiplies by and of
        the embedding; the full-precision copies are freed: see
        :func:`~hybridkv.engine.loading.quantize_weights.quantize_model`."""
        from hybridkv.engine.loading.quantize_weights import quantize_model

        quantize_model(self, mode, compute_dtype)
        self.use_cpu_kernels(self.model.norm.weight.device.type == "cpu")  # the quantized model's fast path

    def use_cpu_kernels(self, enable: bool = True) -> bool:
        """Run the RMSNorms, RoPE and gated activations of fp32 rows through the fused C kernels
        (:mod:`hybridkv.engine.cpu_ops`) when ``enable`` and the kernels build here; returns whether they do. The loader turns this
        on for quantized models (their fast path); the exact path (`none`) keeps torch's ops."""
        on = bool(enable) and cpu_ops.load() is not None
        for module in self.modules():
            if isinstance(module, CustomOp):  # RMSNorm, RoPE, the gated activation: the choice is made here
                module.use_cpu_kernels(on)
        self.cpu_kernels = on
        self.fused_decode = None
        if on and self.quantization is not None:
            from hybridkv.engine.attention.cpu_stack import FusedDecode

            self.fused_decode = FusedDecode.build(self)  # None: some layer cannot run fused
        return on

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the model was loaded in and computes in (its embedding's, quantized or not)."""
        return self.embed_dtype if self.embed_dtype is not None else self.model.embed_tokens.weight.dtype

    # ---------------------------------------------------------------- running
    def lookup_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: the embedding rows (dequantized when quantized)."""
        if self.embed_quant is not None:
            return self.embed_quant.rows(input_ids).to(self.embed_dtype)
        return self.model.embed_tokens(input_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        return self.lookup_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids / positions [T] -> final-norm hidden states [T, hidden].

        With ``meta.output_seqs`` set, [N, hidden] for the last token of each of those
        sequences: every layer still computes and stores K/V for all T tokens, but the
        last layer's attention queries, MLP and everything after run on these rows
        only (in a prefill step, nearly a whole layer's work skipped).
        """
        keep = meta.output_rows()  # [N] or None
        quantized = self.quantization is not None and self.cpu_kernels
        # the C kernels hold the cores in a quantized model's decode steps, torch in everything else
        # (another model's steps in this process included; cpu_ops.hold_cores, a no-op when they are held)
        cpu_ops.hold_cores(quantized and meta.is_decode())
        hidden = self.embed(input_ids)
        rope = self.step_tables(positions, hidden.dtype)
        fused = self.fused_decode
        if fused is not None and fused.accepts(hidden, meta):  # a quantized decode step: one C call
            return self.model.norm.forward(fused.run(hidden, rope, meta))
        *layers, last = self.model.layers  # (slicing a ModuleList builds a new one each step)
        for layer in layers:
            hidden = layer.forward(hidden, positions, rope, meta)
        hidden = last.forward(hidden, positions, rope, meta, keep=keep)
        if quantized:  # the output projection's rows go to the kernels' threads
            cpu_ops.hold_cores(True)
        return self.model.norm.forward(hidden)

    def step_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
        """What every layer of a step reads, computed once per step: each rotary's tables by its name
        (a family adds its own per-step tensors under its own keys)."""
        return {name: r.tables(positions, dtype) for name, r in self.rotaries.items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]."""
        return self.lm_head(hidden)

    # ------------------------------------------------------ what the KV needs
    def attention_type(self, layer_idx: int) -> AttentionType:
        """The attention type of ``layer_idx``, as the planner reads the config (``self.layout``)."""
        return self._types[layer_idx]

    def layer_attention_types(self) -> list[tuple[str, int | None]]:
        """Per layer ``("full", None)``, ``("sliding", W)`` or ``("chunked", C)``."""
        return [self.attention_type(i).as_tuple() for i in range(self.num_layers)]

    def kv_cache_specs(self, block_size: int, dtype: str = "bfloat16") -> list[KVCacheSpec | None]:
        """One core KV cache spec per layer, the planner's (None for a layer with no KV: a
        linear-attention layer keeps a state, :meth:`~hybridkv.planner.ModelLayers.state_specs`)."""
        layout = model_layers(self.config, family=self.family, block_size=block_size, dtype=dtype)
        out: list[KVCacheSpec | None] = [None] * self.num_layers
        for i, spec in zip(layout.cache_layers, layout.specs):
            if isinstance(spec, KVCacheSpec):
                out[i] = spec
        return out
