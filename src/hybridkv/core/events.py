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
    """Full blocks became cached (content-addressed) in one group.

    ``block_hashes[i]`` is the hash of block ``block_ids[i]``; ``parent_hash`` is the
    hash of the block before the first (None for a request's first block).
    """

    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    parent_hash: BlockHash | None
    block_size: int
    group_id: int
    spec_kind: str


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
