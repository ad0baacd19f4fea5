"""Sliding-window attention: token i attends to tokens (i - W, i]."""

from __future__ import annotations

from typing import Sequence

from hybridkv.core.block_pool import KVCacheBlock
from hybridkv.core.hashing import BlockHash
from hybridkv.core.managers.base import AttentionManager
from hybridkv.core.specs import SlidingWindowSpec, cdiv

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(AttentionManager):
    """A hit of L tokens needs only the W - 1 tokens before L: cdiv(W - 1, block) blocks.

    Hit search scans right to left for the rightmost run of that many cached
    blocks; everything before the run becomes null. A shorter run that starts at
    block 0 is a hit too (there is nothing before it to need).

    Example (block 2, W 4 → runs of cdiv(3, 2) = 2 blocks, max_length 12, cached
    blocks 1, 3, 4): scan 5 miss, 4 hit, 3 hit → run of 2 ending at block 4 →
    [null, null, null, b3, b4] → 10 tokens. With only blocks 0 and 3 cached the
    longest valid hit is the run [b0] from position 0 → 2 tokens.

    Skipping: once n tokens are computed the next token (index n) attends to
    (n - W, n], so tokens before n - W + 1 are dead: W 4, block 2, n 7 → 4 tokens
    → blocks 0 and 1 are freed.
    """

    def __init__(self, spec: SlidingWindowSpec, *args, **kwargs):
        super().__init__(spec, *args, **kwargs)
        self.sliding_window = spec.sliding_window
        self.contiguous_blocks = cdiv(spec.sliding_window - 1, spec.block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def next_skip_at(self, num_skipped_blocks: int) -> int:
        # block k dies once n - W + 1 >= (k + 1) * block. W 4, block 2, k 0 -> n >= 5.
        return (num_skipped_blocks + 1) * self.block_size + self.sliding_window - 1

    def longest_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[list[KVCacheBlock], int]:
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        need = self.contiguous_blocks
        null = self.null_block
        if need == 0:  # W == 1: a token needs nothing before it
            return [null] * max_blocks, max_blocks * self.block_size
        computed = [null] * max_blocks
        lookup = self._lookup
        run = 0
        end = None
        for i in range(max_blocks - 1, -1, -1):
            block = lookup(block_hashes[i])
            if block is None:
                run = 0
                continue
            computed[i] = block
            run += 1
            if run >= need:
                end = i + run
                break
        if end is None:  # the leading run (possibly empty) reaches position 0
            end = run
        del computed[end:]
        return computed, end * self.block_size
