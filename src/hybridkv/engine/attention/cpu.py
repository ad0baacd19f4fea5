"""The ``cpu`` attention backend: decode steps through the fused C kernel, the rest as the reference.

A step in which every sequence computes one token (a decode step) with fp32 queries, an fp32,
bf16 or fp16 KV cache, no
learned sinks, no soft-capping and every row's output wanted runs
:func:`~hybridkv.engine.cpu_ops.decode_attention`: each sequence's new K/V written to its slot,
then its query attends to the keys ``first_key(p) .. p`` of its attention type read straight
through the block table (no gathered copy, no padding, no mask). Anything else (prefill chunks,
bf16 queries, sinks, ``storage.debug`` checks) takes the reference path, as do all steps where the
kernels cannot be built. Results equal the reference's up to float rounding (the kernel sums in
another order and uses a polynomial ``exp``): tests/engine/test_attention.py runs both against
the same dense reference. The backend also offers the fused decode step of a whole quantized
model (``decode_stack``: :mod:`~hybridkv.engine.attention.cpu_stack`).
"""

from __future__ import annotations

import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine.attention.backend import AttentionBackend
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.reference import ReferenceState, reference_paged_attention
from hybridkv.engine.attention.types import AttentionType

__all__ = ["CpuBackend", "CpuState"]


class CpuState(ReferenceState):
    """The reference's step state (for the steps that fall back) plus, per attention type, the
    decode step's key ranges."""

    __slots__ = ("_positions",)

    def __init__(self, meta: AttentionMetadata) -> None:
        super().__init__(meta)
        self._positions: dict[AttentionType, tuple[torch.Tensor, torch.Tensor]] = {}

    def decode_positions(self, attn: AttentionType) -> tuple[torch.Tensor, torch.Tensor]:
        """first [S], pos [S] int64: sequence s's query at ``pos[s]`` reads keys ``first[s] .. pos[s]``."""
        if attn not in self._positions:
            pos = self.meta.start  # a decode step: each sequence's one query is at its computed count
            self._positions[attn] = (attn.first_key(pos).contiguous(), pos.contiguous())
        return self._positions[attn]


class CpuBackend(AttentionBackend):
    """Decode steps in C on the CPU (fp32 queries; fp32 / bf16 / fp16 KV); everything else through the reference."""

    name = "cpu"
    decode_stack = True

    def unavailable(self, device_type: str) -> str | None:
        if device_type != "cpu":
            return "it runs on a CPU, not " + device_type
        return cpu_ops.unavailable()

    def new_state(self, meta: AttentionMetadata) -> CpuState:
        return CpuState(meta)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        layer: int,
        attn: AttentionType,
        scale: float,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        storage = meta.storage
        fused = (
            sinks is None
            and softcap is None
            and keep is None
            and not storage.debug
            and storage.dtype in cpu_ops.KV_TYPES
            and query.dtype == torch.float32
            and key.dtype == torch.float32
            and meta.is_decode()
            and query.stride(-1) == 1
            and key.stride(-1) == 1
            and value.stride(-1) == 1
            and cpu_ops.load() is not None
        )
        if not fused:
            return reference_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep,
                                             state=meta.state)
        group = storage.group_of(layer)
        first, pos = meta.state.decode_positions(attn)
        kv = storage.layer_kv(layer)  # [2 Hkv, num_slots, D]
        return cpu_ops.decode_attention(
            query, key, value, kv, meta.block_tables[group], first, pos, storage.block_size, scale
        )  # [S, Hq, D]
