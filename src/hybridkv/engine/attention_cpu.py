"""The ``"cpu"`` attention backend: decode steps through the fused C kernel, the rest as the reference.

A step in which every sequence computes one token (a decode step) with fp32 queries and
KV, no learned sinks, no soft-capping and every row's output wanted runs
:func:`~hybridkv.engine.cpu_ops.decode_attention`: each sequence's new K/V written to its
slot, then its query attends to the keys ``first_key(p) .. p`` of its attention type read
straight through the block table (no gathered copy, no padding, no mask). Anything else
(prefill chunks, bf16 KV, sinks, ``storage.debug`` checks) takes the reference path
(:func:`~hybridkv.engine.attention.reference_paged_attention`), as do all steps where the
kernels cannot be built. Results equal the reference's up to float rounding (the kernel
sums in another order and uses a polynomial ``exp``): tests/engine/test_attention.py runs
both against the same dense reference.
"""

from __future__ import annotations

import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine.attention import AttentionMetadata, AttentionType, reference_paged_attention

__all__ = ["cpu_paged_attention", "decode_positions"]


def decode_positions(meta: AttentionMetadata, attn: AttentionType) -> tuple[torch.Tensor, torch.Tensor]:
    """first [S], pos [S] int64: sequence s's query at ``pos[s]`` reads keys ``first[s] .. pos[s]``."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        pos = meta.start  # a decode step: each sequence's one query is at its computed count
        return attn.first_key(pos).contiguous(), pos.contiguous()

    return meta.memo(("cpu_decode", attn), make)


def cpu_paged_attention(
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
    """:func:`~hybridkv.engine.attention.paged_attention`'s contract; decode steps in the C kernel."""
    storage = meta.storage
    fused = (
        sinks is None
        and softcap is None
        and keep is None
        and not storage.debug
        and storage.dtype == torch.float32
        and query.dtype == torch.float32
        and key.dtype == torch.float32
        and meta.is_decode()
        and query.stride(-1) == 1
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and cpu_ops.load() is not None
    )
    if not fused:
        return reference_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep)
    group = storage.group_of(layer)
    first, pos = decode_positions(meta, attn)
    kv = storage.layer_kv(layer)  # [2 Hkv, num_slots, D]
    return cpu_ops.decode_attention(
        query, key, value, kv, meta.block_tables[group], first, pos, storage.block_size, scale
    )  # [S, Hq, D]
