"""Small builders shared by the core tests."""

from __future__ import annotations

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec


def full(bs: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")


def sliding(window: int, bs: int = 4, tail_only: bool = False) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window,
                             tail_only=tail_only)


def chunked(chunk: int, bs: int = 4, tail_only: bool = False) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32",
                                     attention_chunk_size=chunk, tail_only=tail_only)


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


def pool_snapshot(pool: BlockPool) -> tuple:
    """Everything a BlockPool holds: per block (ref_cnt, hash, group, stripe members),
    the free queue in order, the hash maps, the free count and the cache epoch."""
    blocks = tuple(
        (b.ref_cnt, b.block_hash, b.group_id, b.width, tuple(m.block_id for m in b.stripe) if b.stripe else None)
        for b in pool.blocks
    )
    fq = pool.free_queue
    queue = (tuple(fq.lru), tuple((w, ids(st)) for w, st in sorted(fq.stacks.items()) if st))
    maps = tuple(
        tuple(sorted((h, tuple(sorted(e)) if type(e) is dict else e.block_id) for h, e in m.items()))
        for m in pool._cached
    )
    return blocks, queue, maps, pool.num_free_blocks, pool.cache_epoch


def manager_snapshot(kv, requests=()) -> tuple:
    """A KVCacheManager's whole state (pool, every manager's tables and counts, the live
    and quiet sets, stats) plus each given request's tokens, hashes and computed count."""
    tables = tuple(
        tuple(sorted((rid, tuple(ids(st.blocks)), st.num_cached, st.num_skipped) for rid, st in m.requests.items()))
        for m in kv.coordinator.managers
    )
    reqs = tuple(
        (r.request_id, tuple(r.all_token_ids), tuple(r.block_hashes), r.num_computed_tokens) for r in requests
    )
    return (pool_snapshot(kv.pool), tables, tuple(sorted(kv._live)), tuple(sorted(kv._quiet)),
            (kv.stats.requests, kv.stats.queries, kv.stats.hits), reqs)


def state(bs: int = 4):
    """A tiny recurrent-state spec (one float32 element: the manager reads only its page)."""
    from hybridkv.core.state_spec import StateSpec

    return StateSpec(block_size=bs, shapes=((1,),), dtypes=("float32",))
