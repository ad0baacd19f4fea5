"""A quantized model's decode step as one C call for all its decoder layers.

On the quantized CPU path a small model's decode step spends more time in Python between its
kernels than in them (SmolLM2 135M: 30 layers x ~12 calls a layer). :class:`FusedDecode`
describes every layer once, as a plan of pointers (its norms' multipliers, its quantized
weights, its KV storage), and runs a decode step's layers in
:func:`~hybridkv.engine.cpu_ops.decode_stack`: the same kernels in the same order as the
layers' ``forward`` (RMSNorm, quantized matmul, q/k norms, RoPE, paged attention, gated
activation, residual adds), with the matmuls on the kernels' threads.

Which layers: those that describe themselves (:meth:`DecoderLayer.decode_parts`: Llama's
plain residual layer, Gemma 3's sandwich norms) with an attention that does
(:meth:`LlamaAttention.decode_parts`: rotate-half RoPE, optional per-head q/k norms, no
biases or sinks) and a gated MLP with a fused kernel activation, every matrix quantized.
A model with any other layer keeps the per-layer path. Which steps: decode steps (one query
per sequence) on the ``cpu`` attention backend with fp32 rows (any KV dtype the C attention
reads), every row an output;
anything else runs the layers' ``forward``.
"""

from __future__ import annotations

import struct
import weakref
from typing import Any

import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import AttentionType

__all__ = ["FusedDecode"]

#: the C plan's per-layer record (decode_stack.c): 17 int64, 4 weights of 7 int64, 2 doubles
_RECORD = struct.Struct("<17q28q2d")


class FusedDecode:
    """The plan of a model's layers; :meth:`run` computes a decode step's layers in one call."""

    def __init__(self, parts: list[dict[str, Any]], ropes: list[str], attns: list[AttentionType]) -> None:
        self.parts = parts  # per layer: what decode_parts() gave (keeps the tensors alive)
        self.ropes = ropes
        self.attns = attns
        self._plan: tuple[Any, torch.Tensor] | None = None  # (weakref to the storage, plan bytes as a tensor)

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        """The plan of ``model``'s layers, or None when a layer cannot be described (or the kernels
        do not build here)."""
        if cpu_ops.load() is None:
            return None
        parts = []
        for layer in model.model.layers:
            describe = getattr(layer, "decode_parts", None)
            p = describe() if describe is not None else None
            if p is None:
                return None
            parts.append(p)
        ropes = sorted({p["rope"] for p in parts})
        attns = list(dict.fromkeys(p["attn"] for p in parts))
        return cls(parts, ropes, attns)

    def _layer_plan(self, storage) -> torch.Tensor:
        """The plan's bytes for ``storage`` (its KV pointers), made once per storage."""
        if self._plan is not None and self._plan[0]() is storage:
            return self._plan[1]
        records = []
        for p in self.parts:
            kv = storage.layer_kv(p["layer"])  # [2 Hkv, slots, D]
            ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
            records.append(_RECORD.pack(
                p["num_heads"], p["num_kv_heads"], p["head_dim"], p["hidden"], p["intermediate"],
                ptr(p["ln1"]), ptr(p["ln2"]), ptr(p["post_attn"]), ptr(p["post_ff"]), ptr(p["qk_norm"]),
                self.ropes.index(p["rope"]), self.attns.index(p["attn"]), storage.group_of(p["layer"]),
                kv.data_ptr(), kv.shape[1], cpu_ops.ACTIVATIONS[p["act"]], cpu_ops.KV_TYPES[storage.dtype],
                *p["qkv"].kernel_fields(), *p["o"].kernel_fields(), *p["gate_up"].kernel_fields(),
                *p["down"].kernel_fields(), p["eps"], p["scale"],
            ))
        plan = torch.frombuffer(bytearray(b"".join(records)), dtype=torch.uint8)
        self._plan = (weakref.ref(storage), plan)
        return plan

    def accepts(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can run fused: a decode step on a backend with the ``decode_stack``
        capability (the ``cpu`` backend), fp32 rows, an fp32 / bf16 / fp16 KV cache."""
        storage = meta.storage
        return (
            meta.backend.decode_stack
            and hidden.dtype == torch.float32
            and hidden.is_contiguous()
            and storage.dtype in cpu_ops.KV_TYPES
            and not storage.debug
            and meta.output_rows() is None
            and meta.is_decode()
            and all(t.dtype == torch.int64 and t.stride(1) == 1 for t in meta.block_tables)
        )

    def run(self, hidden: torch.Tensor, rope: dict[str, Any], meta: AttentionMetadata) -> torch.Tensor:
        """hidden [S, hidden] fp32 (one row per sequence) -> the last layer's output, in place."""
        storage = meta.storage
        plan = self._layer_plan(storage)
        fields = [hidden.shape[0], storage.block_size, len(self.ropes), len(self.attns), len(meta.block_tables)]
        keep = [plan]
        for name in self.ropes:
            cos, sin = rope[name]
            if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()):
                cos, sin = cos.float().contiguous(), sin.float().contiguous()
                keep += [cos, sin]
            fields += [cos.data_ptr(), sin.data_ptr(), cos.stride(0)]
        for attn in self.attns:
            first, pos = meta.state.decode_positions(attn)
            fields += [first.data_ptr(), pos.data_ptr()]
        for tables in meta.block_tables:  # [S, W] int64 rows with unit stride
            fields += [tables.data_ptr(), tables.stride(0), tables.shape[1]]
        step = torch.tensor(fields, dtype=torch.int64)
        cpu_ops.load().decode_stack(plan.data_ptr(), len(self.parts), step.data_ptr(), hidden.data_ptr())
        return hidden
