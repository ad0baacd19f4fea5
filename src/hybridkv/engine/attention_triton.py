"""The ``"triton"`` attention backend: one KV-write kernel and one attention launch per layer.

:func:`~hybridkv.engine.attention.paged_attention` sends a step here when its metadata's
backend is ``"triton"``. Per step and query-head ratio the query blocks are planned once
(:func:`~hybridkv.engine.kernels.paged_attention.query_blocks`, memoised on the
metadata, as the reference backend memoises its layouts); per layer the kernels read the
group's block table and the step's sequence lengths, nothing gathered:

* a step whose sequences all decode one token (and want it) runs the decode kernel,
  row ``s`` = sequence ``s``, its keys split across programs when few rows would leave
  the GPU idle (flash-decoding);
* any other step runs the varlen kernel over its query blocks; the last layer's
  ``keep`` rows (each sampled sequence's last token) become one-query blocks.
"""

from __future__ import annotations

import torch

from hybridkv.engine.kernels.kv_write import write_kv
from hybridkv.engine.kernels.paged_attention import (
    block_q_for,
    decode_splits,
    num_sms,
    paged_attention_fwd,
    query_blocks,
    tile_n,
)

__all__ = ["triton_paged_attention"]


def _max_keys(meta, kind: str, size: int | None) -> int:
    """The most keys one decode row of this step reads under ``kind``."""
    longest = max(a + n for a, n in zip(meta.starts, meta.query_lens))
    return longest if kind == "full" else min(longest, int(size))


def triton_paged_attention(query, key, value, meta, layer: int, attn, scale: float, sinks=None, softcap=None,
                           keep=None) -> torch.Tensor:
    """As :func:`~hybridkv.engine.attention.paged_attention` (same shapes), with the Triton kernels."""
    storage = meta.storage
    group = storage.group_of(layer)
    cache = storage.kv_cache(layer)  # [2, Hkv, num_blocks, block_size, D]
    write_kv(key, value, cache[0], cache[1], meta.slot_mappings[group])
    table = meta.block_tables[group]  # [S, W]
    rep = query.shape[1] // cache.shape[1]
    if keep is not None:
        query = query.index_select(0, keep)  # [N, Hq, D]
    if keep is None and max(meta.query_lens) == 1:  # a decode step
        splits = meta.decode_splits or meta.memo(
            ("triton_splits", attn),
            lambda: decode_splits(meta.num_seqs, cache.shape[1], _max_keys(meta, attn.kind, attn.size),
                                  tile_n(query.shape[2]), num_sms(query.device)),
        )
        return paged_attention_fwd(query, cache[0], cache[1], table, meta.seq_len, attn.kind, attn.size, scale,
                                   sinks=sinks, softcap=softcap, num_splits=splits)
    plan = meta.memo(("triton_plan", rep, keep is not None), lambda: _plan(meta, rep, keep is not None))
    return paged_attention_fwd(query, cache[0], cache[1], table, meta.seq_len, attn.kind, attn.size, scale,
                               plan=plan, sinks=sinks, softcap=softcap)


def _plan(meta, rep: int, outputs_only: bool) -> torch.Tensor:
    """The step's query blocks [NQB, 4] on the device (one copy)."""
    from hybridkv.engine.host import long_tensor

    if outputs_only:
        seqs = meta.output_seqs or []
        ends = [meta.starts[s] + meta.query_lens[s] - 1 for s in seqs]
        rows = query_blocks(ends, [1] * len(seqs), 1, seqs=seqs)
    else:
        rows = query_blocks(meta.starts, meta.query_lens, block_q_for(rep, False))
    return long_tensor(rows, meta.positions.device).view(-1, 4)

