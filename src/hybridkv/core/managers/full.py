"""Full attention: every token attends to every earlier token."""

from __future__ import annotations

from typing import Sequence

from hybridkv.core.hashing import BlockHash
from hybridkv.core.managers.base import AttentionManager, GroupBlocks

__all__ = ["FullAttentionManager"]


class FullAttentionManager(AttentionManager):
    """Hits run left to right until the first miss; nothing is ever skipped.

    Example (block 4, max_length 13, cached blocks 0 and 1, block 2 missing):
    blocks [b0, b1] → 8 tokens.
    """

    downward_closed = True

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[GroupBlocks, int]:
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        if self.num_groups == 1:
            lookup = self.pool.lookup
            g = self.group_ids[0]
            hit: list = []
            append = hit.append
            for i in range(max_blocks):
                block = lookup(block_hashes[i], g)
                if block is None:
                    break
                append(block)
            return [hit], len(hit) * self.block_size
        computed: GroupBlocks = [[] for _ in range(self.num_groups)]
        get = self.pool.get_cached_block
        gids = self.group_ids
        for i in range(max_blocks):
            blocks = get(block_hashes[i], gids)
            if blocks is None:
                break
            for lst, block in zip(computed, blocks):
                lst.append(block)
        return computed, len(computed[0]) * self.block_size
