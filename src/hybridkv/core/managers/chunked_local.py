"""Chunked local attention (Llama 4 iRoPE): token i attends to [floor(i / C) * C, i]."""

from __future__ import annotations

from typing import Sequence

from hybridkv.core.block_pool import KVCacheBlock
from hybridkv.core.hashing import BlockHash
from hybridkv.core.managers.base import AttentionManager
from hybridkv.core.specs import ChunkedLocalAttentionSpec

__all__ = ["ChunkedLocalAttentionManager"]


class ChunkedLocalAttentionManager(AttentionManager):
    """Tokens before the current chunk are never attended to again.

    Hit search, for a hit of at most ``max_length`` tokens: the next token would be
    at index ``max_length``, whose chunk starts at ``s = floor(max_length / C) * C``.
    Blocks wholly before ``s`` count as computed (null blocks, no lookup); from the
    block holding ``s`` the hit extends through cached blocks until the first miss.

    Examples (block 1, C 2; ``[a b]`` is one chunk):

    * ``[miss miss][miss miss][miss miss]``, max_length 5 → s = 4 → block 4 misses → 4
    * ``[miss miss][hit  miss][miss miss]``, max_length 5 → 4 (block 2 is never looked at)
    * ``[miss miss][miss miss][hit  miss]``, max_length 5 → block 4 hits → 5
    * block 16, C 64, max_length 128 → s = 128: eight null blocks, 128 tokens, no lookup
    * C not a multiple of the block: block 8, C 20, max_length 40 → s = 40 → 5 null
      blocks; max_length 39 → s = 20 → blocks 0, 1 null, block 2 (tokens 16-23,
      straddling 20) must be a hit. If it misses, a hit of 16 would leave token 16
      (chunk [0, 20)) reading null blocks 0 and 1, so the search restarts at
      max_length 16: s = 0, blocks 0 and 1 must hit.

    Skipping: with n tokens computed the next token's chunk starts at
    ``floor(n / C) * C``; every block wholly before it is freed. Block 128, C 1024:
    n 1023 → nothing; n 1024 → blocks 0-7; a block straddling a chunk start is kept
    (block 8, C 20, n 21 → 20 tokens → blocks 0, 1 freed, block 2 kept).
    """

    def __init__(self, spec: ChunkedLocalAttentionSpec, *args, **kwargs):
        super().__init__(spec, *args, **kwargs)
        self.attention_chunk_size = spec.attention_chunk_size

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def next_skip_at(self, num_skipped_blocks: int) -> int:
        # block k dies once the chunk start passes its end: (k + 1) * block <= floor(n / C) * C
        # -> n >= cdiv((k + 1) * block, C) * C. Block 8, C 20, k 2 -> n >= 40.
        chunk = self.attention_chunk_size
        return -(-((num_skipped_blocks + 1) * self.block_size) // chunk) * chunk

    def longest_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[list[KVCacheBlock], int]:
        bs = self.block_size
        chunk = self.attention_chunk_size
        null = self.null_block
        while True:
            max_blocks = min(max_length // bs, len(block_hashes))
            chunk_start = max_length // chunk * chunk
            start = min(chunk_start // bs, max_blocks)
            computed = [null] * start + self._scan(block_hashes, start, max_blocks)
            hit = len(computed) * bs
            if hit >= chunk_start or hit == max_length:
                return computed, hit
            # The block straddling the chunk start missed: the hit ends before the
            # chunk start, in an earlier chunk whose tokens the null blocks do not
            # hold. Retry at that (strictly shorter) length.
            max_length = hit
