"""Full attention: every token attends to every earlier token."""

from __future__ import annotations

from typing import Sequence

from hybridkv.core.block_pool import KVCacheBlock
from hybridkv.core.hashing import BlockHash
from hybridkv.core.managers.base import AttentionManager

__all__ = ["FullAttentionManager"]


class FullAttentionManager(AttentionManager):
    """Hits run left to right until the first miss; nothing is ever skipped.

    Example (block 4, max_length 13, cached blocks 0 and 1, block 2 missing):
    blocks [b0, b1] → 8 tokens.
    """

    downward_closed = True

    def longest_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[list[KVCacheBlock], int]:
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        hits = self._scan(block_hashes, 0, max_blocks)
        return hits, len(hits) * self.block_size
