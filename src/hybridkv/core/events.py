"""KV cache events a caller can drain (e.g. to keep an external KV index in sync).

Events are recorded only when the manager is built with ``enable_kv_events``;
``KVCacheManager.take_events()`` returns and clears them in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core.hashing import BlockHash

__all__ = ["KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared"]


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """Base of every KV cache event."""


@dataclass(frozen=True, slots=True)
class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one request became cached (content-addressed) in one group.

    ``block_hashes[i]`` is the hash of block ``block_ids[i]``; ``parent_hash`` is the
    hash of the request's block before the first (None for a request's first block),
    whether or not that block is cached in this group. ``token_ids`` are the tokens
    of all the blocks, flat: ``token_ids[i * block_size:(i + 1) * block_size]`` are
    block i's (empty only when the pool was called without tokens, as in unit tests).
    ``spec_kind`` is the group's attention type (vLLM's names: "full_attention",
    "sliding_window", "chunked_local_attention") and ``attention_span`` its window or
    chunk size (None for full attention), so a consumer can tell a sliding block
    that fell out of the window from a lost prefix.

    Example (block_size 2, one full group, prompt [7 8 9 10 11]): the first step
    caches blocks 0-1 as ``BlockStored((h0, h1), (1, 2), None, 2, 0, "full_attention",
    (7, 8, 9, 10), None)``; when token 12 completes block 2,
    ``BlockStored((h2,), (3,), h1, 2, 0, "full_attention", (11, 12), None)``.
    A run interrupted by a null block (a sliding group's blocks already out of the
    window) or a block cached before gives one event per consecutive run.
    """

    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    parent_hash: BlockHash | None
    block_size: int
    group_id: int
    spec_kind: str
    token_ids: tuple[int, ...]
    attention_span: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved(KVCacheEvent):
    """A cached block was evicted (its content address is gone)."""

    block_hash: BlockHash
    block_id: int
    group_id: int
    spec_kind: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""
