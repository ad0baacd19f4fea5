"""The ``triton`` backend's forward: one KV-write kernel and one attention launch per layer.

Per step and query-head ratio the query blocks are planned once
(:func:`~hybridkv.engine.attention.triton_kernels.paged_attention.query_blocks`, kept in the
step state :class:`TritonState`); per layer the kernels read the group's block table and the
step's sequence lengths, nothing gathered:

* a step whose sequences all decode one token (and want it) runs the decode kernel,
  row ``s`` = sequence ``s``, its keys split across programs when few rows would leave
  the GPU idle (flash-decoding);
* any other step runs the varlen kernel over its query blocks; the last layer's
  ``keep`` rows (each sampled sequence's last token) become one-query blocks;
* a step whose sequences share a long prefix in the layer's group attends to it once
  (cascade attention, :mod:`hybridkv.engine.attention.cascade`): a prefix pass for all queries,
  a suffix pass per sequence, merged; never in a CUDA-graph step (its shapes are fixed).

A ``tail_only`` group with unstored positions this step (``meta.gap_groups``) writes the
tokens that have slots (the others have slot -1) and its attention reads every key the step
computed from the step's K / V (the kernel's two sources), the rest through the table.

Decode steps may be captured as CUDA graphs (:mod:`~hybridkv.engine.attention.decode_graphs`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.plan import first_key
from hybridkv.engine.attention.cascade import cascade_prefix_len
from hybridkv.engine.attention.triton_kernels.kv_write import write_kv
from hybridkv.engine.attention.triton_kernels.merge import merge_attention
from hybridkv.engine.attention.triton_kernels.paged_attention import (
    block_q_for,
    decode_splits,
    num_sms,
    paged_attention_fwd,
    query_blocks,
    tile_n,
)
from hybridkv.engine.attention.types import AttentionType
from hybridkv.errors import InvariantViolation

__all__ = ["TritonState", "triton_paged_attention"]


class TritonState:
    """The triton backend's step state, each part made on first use: per (group, attention type)
    the cascade prefix and the debug read check; per attention type the decode splits; per
    (query-head ratio, outputs only) the query blocks; per (ratio, outputs only, prefix) the
    cascade's shared plan."""

    __slots__ = ("meta", "_parts")

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._parts: dict[tuple, Any] = {}

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` once per step under ``key`` (a tuple whose first item names the part)."""
        try:
            return self._parts[key]
        except KeyError:
            value = self._parts[key] = make()
            return value


def _max_keys(meta: AttentionMetadata, kind: str, size: int | None) -> int:
    """The most keys one decode row of this step reads under ``kind`` (a graph step: at most ever)."""
    longest = meta.decode_key_bound or max(a + n for a, n in zip(meta.starts, meta.query_lens))
    return longest if kind == "full" else min(longest, int(size))


def triton_paged_attention(
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
    """:meth:`~hybridkv.engine.attention.backend.AttentionBackend.forward` with the Triton kernels (same shapes)."""
    state: TritonState = meta.state
    storage = meta.storage
    group = storage.group_of(layer)
    cache = storage.kv_cache(layer)  # [2, Hkv, num_blocks, block_size, D]
    if storage.debug:  # debug_checks: the reference's checks (they read the slots back)
        storage.check_slots(layer, meta.slot_mappings[group])
        if meta.block_ids is not None:
            state.get(("reads_checked", group, attn), lambda: _check_reads(meta, group, attn))
    write_kv(key, value, cache[0], cache[1], meta.slot_mappings[group])  # slot -1: not stored
    table = meta.block_tables[group]  # [S, W]
    new_kv = None
    if group in meta.gap_groups:  # the step's own keys from its K / V
        new_from, new_row = state.get(("new_rows",), lambda: _new_rows(meta))
        new_kv = (key, value, new_from, new_row)
    rep = query.shape[1] // cache.shape[1]
    if keep is not None:
        query = query.index_select(0, keep)  # [N, Hq, D]
    prefix = state.get(("cascade", group, attn), lambda: _cascade_prefix(meta, group, attn, query.shape[1], cache))
    if prefix:
        return _cascade(query, cache, table, meta, attn, scale, sinks, softcap, prefix, rep, keep is not None, new_kv)
    if keep is None and meta.is_decode():
        splits = state.get(
            ("splits", attn),
            lambda: decode_splits(meta.num_seqs, cache.shape[1], _max_keys(meta, attn.kind, attn.size),
                                  tile_n(query.shape[2]), num_sms(query.device)),
        )
        return paged_attention_fwd(query, cache[0], cache[1], table, meta.seq_len, attn.kind, attn.size, scale,
                                   sinks=sinks, softcap=softcap, num_splits=splits)
    plan = state.get(("plan", rep, keep is not None), lambda: _plan(meta, rep, keep is not None))
    return paged_attention_fwd(query, cache[0], cache[1], table, meta.seq_len, attn.kind, attn.size, scale,
                               plan=plan, sinks=sinks, softcap=softcap, new_kv=new_kv)


def _new_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """new_from [S] (each sequence's first position this step) and new_row [S] (its K/V row)."""
    return meta.start, meta.ints(meta.first_rows()[:-1])


def _check_reads(meta: AttentionMetadata, group: int, attn: AttentionType) -> bool:
    """Refuse (InvariantViolation) a key a query needs that its table maps to the null block (in a
    gap group only the keys before the step count: its own are read from its K / V)."""
    bs = meta.storage.block_size
    gap = group in meta.gap_groups
    for s, (a, n) in enumerate(zip(meta.starts, meta.query_lens)):
        table = meta.block_ids[s][group]
        last = -(-a // bs) if gap else (a + n - 1) // bs + 1
        for b in range(first_key(attn.kind, attn.size, a) // bs, last):
            if table[b] == 0:
                raise InvariantViolation(
                    f"group {group} ({attn.kind}): sequence {s} needs key positions in block {b}, "
                    "which its block table maps to the null block"
                )
    return True


def _cascade_prefix(meta: AttentionMetadata, group: int, attn: AttentionType, num_heads: int,
                    cache: torch.Tensor) -> int:
    """Tokens of the prefix every sequence shares in ``group`` that this step attends to once (0: none)."""
    if meta.block_ids is None or meta.decode_key_bound is not None:  # a graph step: fixed shapes
        return 0
    return cascade_prefix_len(
        [t[group] for t in meta.block_ids], meta.starts, meta.query_lens, meta.storage.block_size,
        attn.kind, attn.size, num_heads, cache.shape[1], num_sms(meta.positions.device),
    )


def _cascade(query, cache, table, meta, attn, scale, sinks, softcap, prefix: int, rep: int,
             outputs_only: bool, new_kv=None) -> torch.Tensor:
    """query [N, Hq, D] -> [N, Hq, D]: keys ``[0, prefix)`` once for all rows, the rest per sequence."""
    rows, num_heads = query.shape[0], query.shape[1]
    block_q = block_q_for(rep, False)

    def shared_plan() -> torch.Tensor:  # every row after the prefix, read through sequence 0's table
        flat = [v for r in range(0, rows, block_q) for v in (0, r, prefix - 1, min(block_q, rows - r))]
        return meta.ints(flat).view(-1, 4)

    plan_a = meta.state.get(("cascade_plan", rep, outputs_only, prefix), shared_plan)
    lse_a = torch.empty(rows, num_heads, dtype=torch.float32, device=query.device)
    out_a = paged_attention_fwd(query, cache[0], cache[1], table, meta.seq_len, "full", None, scale,
                                plan=plan_a, softcap=softcap, key_end=prefix, lse=lse_a)
    plan_b = meta.state.get(("plan", rep, outputs_only), lambda: _plan(meta, rep, outputs_only))
    lse_b = torch.empty_like(lse_a)
    out_b = paged_attention_fwd(query, cache[0], cache[1], table, meta.seq_len, attn.kind, attn.size, scale,
                                plan=plan_b, softcap=softcap, key_start=prefix, lse=lse_b, new_kv=new_kv)
    return merge_attention(torch.empty_like(query), out_a, lse_a, out_b, lse_b, sinks)


def _plan(meta: AttentionMetadata, rep: int, outputs_only: bool) -> torch.Tensor:
    """The step's query blocks [NQB, 4] on the device (one copy)."""
    if outputs_only:
        seqs = meta.output_seqs or []
        ends = [meta.starts[s] + meta.query_lens[s] - 1 for s in seqs]
        rows = query_blocks(ends, [1] * len(seqs), 1, seqs=seqs)
    else:
        rows = query_blocks(meta.starts, meta.query_lens, block_q_for(rep, False))
    return meta.ints(rows).view(-1, 4)

