"""Small builders shared by the core tests."""

from __future__ import annotations

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec


def full(bs: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")


def sliding(window: int, bs: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window)


def chunked(chunk: int, bs: int = 4) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32", attention_chunk_size=chunk)


def fake_hashes(n: int) -> list[bytes]:
    """Distinct stand-in block hashes h0, h1, ..."""
    return [f"h{i}".encode() for i in range(n)]


def mark_cached(pool: BlockPool, hashes: list[bytes], cached: list[bool], group: int = 0, first_id: int = 10) -> dict[int, int]:
    """Cache block ``first_id + i`` under hashes[i] for each i with cached[i]; the blocks stay free.

    Returns {position: block_id} of the cached ones.
    """
    out = {}
    for i, (h, is_cached) in enumerate(zip(hashes, cached)):
        if is_cached:
            block = pool.blocks[first_id + i]
            pool.cache_full_blocks([block], [h], 0, 1, group)
            out[i] = block.block_id
    return out


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]
