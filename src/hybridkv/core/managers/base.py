"""What every per-attention-type manager shares.

One manager serves every KV cache group of one spec. Groups with identical specs
advance in lock-step (same tokens, same block boundaries, same skipped prefix), so
the manager does the arithmetic once and applies it to each group's block table:
Llama-4-Scout's three chunked groups cost one manager, not three.

Per request the manager keeps, for each of its groups, the block table (a list of
blocks; the null block stands for skipped tokens) and, shared by all its groups,
``num_cached`` (leading blocks that already have a content address) and
``num_skipped`` (leading blocks that have been replaced by the null block).

A subclass defines the attention type by two methods:

* ``num_skipped_tokens(num_computed_tokens)``: how many leading tokens no future
  token attends to once ``num_computed_tokens`` are computed (the next token is at
  index ``num_computed_tokens``);
* ``find_longest_cache_hit(block_hashes, max_length)``: the longest prefix of at
  most ``max_length`` tokens (whole blocks) whose KV the attention type can reuse,
  as per-group block lists with null blocks for tokens it need not see.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from hybridkv.core.block_pool import BlockPool, KVCacheBlock
from hybridkv.core.hashing import BlockHash
from hybridkv.core.request import Request
from hybridkv.core.specs import KVCacheSpec, cdiv
from hybridkv.errors import InvariantViolation, UnknownRequestError

__all__ = ["AttentionManager", "RequestBlocks", "NEVER"]

GroupBlocks = list[list[KVCacheBlock]]

#: a token count no request reaches
NEVER = 1 << 62


class RequestBlocks:
    """One request's block tables in one manager (one table per group)."""

    __slots__ = ("tables", "ids", "num_cached", "num_skipped")

    def __init__(self, num_groups: int):
        self.tables: GroupBlocks = [[] for _ in range(num_groups)]
        self.ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_cached = 0
        self.num_skipped = 0


class AttentionManager(ABC):
    """Block tables of one attention type for one or more groups with an identical spec."""

    #: True when every prefix of a valid hit is also a valid hit (full attention)
    downward_closed = False

    def __init__(self, spec: KVCacheSpec, group_ids: Sequence[int], pool: BlockPool, enable_caching: bool = True):
        self.spec = spec
        self.block_size = spec.block_size
        self.group_ids = tuple(group_ids)
        self.num_groups = len(self.group_ids)
        self.pool = pool
        self.enable_caching = enable_caching
        self.null_block = pool.null_block
        self.requests: dict[str, RequestBlocks] = {}
        self._group_maps = [pool.group_map(g) for g in self.group_ids]

    # ------------------------------------------------------------ semantics
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no token from index ``num_computed_tokens`` on attends to."""
        return 0

    def next_skip_at(self, num_skipped_blocks: int) -> int:
        """The smallest ``num_computed_tokens`` at which more than ``num_skipped_blocks``
        leading blocks are dead (``NEVER`` for full attention)."""
        return NEVER

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[GroupBlocks, int]:
        """(per-group hit blocks, hit length in tokens); the length is whole blocks, <= max_length."""

    def _scan(self, block_hashes: Sequence[BlockHash], start: int, end: int) -> list[list[KVCacheBlock]]:
        """Cached blocks of positions start, start+1, ... up to the first position (< end)
        that misses in any group: one list per group, all the same length."""
        out: list[list[KVCacheBlock]] = []
        for group_map in self._group_maps:
            get = group_map.get
            hits: list[KVCacheBlock] = []
            append = hits.append
            for i in range(start, end):
                hit = get(block_hashes[i])
                if hit is None:
                    break
                append(next(iter(hit.values())) if type(hit) is dict else hit)
            out.append(hits)
            end = start + len(hits)  # later groups need not look further
        n = end - start
        for hits in out:
            del hits[n:]
        return out

    def _lookup(self, block_hash: BlockHash) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in each of the manager's groups, or None."""
        out = []
        for group_map in self._group_maps:
            hit = group_map.get(block_hash)
            if hit is None:
                return None
            if type(hit) is dict:  # several blocks hold this hash
                hit = next(iter(hit.values()))
            out.append(hit)
        return out

    # ------------------------------------------------------------ life cycle
    def state(self, request_id: str) -> RequestBlocks:
        try:
            return self.requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} has no blocks in group(s) {self.group_ids}") from None

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: GroupBlocks | None,
        num_computed_tokens: int,
    ) -> int:
        """Blocks the pool must hand out to give the request ``num_tokens`` slots.

        Counts new blocks for every group plus prefix-hit blocks that are free now
        (touching them takes them out of the free queue). For a new request the
        skipped prefix of the hit costs nothing: it becomes null blocks.
        Example (chunked C 8, block 4, new request, hit [null null b7], 12 computed,
        num_tokens 20): skipped 8 tokens = 2 blocks; 5 blocks needed, 3 held → 2
        new per group, plus b7 if it is free.
        """
        need = cdiv(num_tokens, self.block_size)
        st = self.requests.get(request_id)
        if st is not None:
            return max(need - len(st.tables[0]), 0) * self.num_groups
        if not new_computed_blocks or not new_computed_blocks[0]:
            return need * self.num_groups
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        held = len(new_computed_blocks[0])
        num_new = max(need - max(skipped, held), 0) * self.num_groups
        evictable = 0
        for blocks in new_computed_blocks:
            for block in blocks[skipped:]:
                if block.ref_cnt == 0 and not block.is_null:
                    evictable += 1
        return num_new + evictable

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: GroupBlocks | None, num_computed_tokens: int
    ) -> None:
        """Start the request's tables with its prefix hit (taking references)."""
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = RequestBlocks(self.num_groups)
        if not new_computed_blocks or not new_computed_blocks[0]:
            return
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        null = self.null_block
        for table, ids, blocks in zip(st.tables, st.ids, new_computed_blocks):
            kept = blocks[skipped:]
            self.pool.touch(kept)
            table.extend([null] * skipped)
            table.extend(kept)
            ids.extend([0] * skipped)
            ids.extend([b.block_id for b in kept])
        st.num_cached = len(st.tables[0])
        st.num_skipped = skipped

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        """Grow every group's table to cover ``num_tokens`` tokens; the new blocks per group."""
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = RequestBlocks(self.num_groups)
        n = cdiv(num_tokens, self.block_size) - len(st.tables[0])
        if n <= 0:
            return [[] for _ in range(self.num_groups)]
        new = self.pool.get_new_blocks(n * self.num_groups)
        if self.num_groups == 1:
            st.tables[0].extend(new)
            st.ids[0].extend([b.block_id for b in new])
            return [new]
        out = []
        for j, (table, ids) in enumerate(zip(st.tables, st.ids)):
            part = new[j * n:(j + 1) * n]
            table.extend(part)
            ids.extend([b.block_id for b in part])
            out.append(part)
        return out

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Give content addresses to the request's full blocks among its first ``num_tokens`` tokens."""
        st = self.requests[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= st.num_cached:
            return
        hashes = request.block_hashes
        for table, g in zip(st.tables, self.group_ids):
            self.pool.cache_full_blocks(table, hashes, st.num_cached, num_full, g)
        st.num_cached = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free every block wholly before ``num_skipped_tokens(num_computed_tokens)``; null in its place.

        Freed tail-most first, so the older (more shareable) prefix stays cached longer.
        """
        st = self.requests.get(request_id)
        if st is None:
            return
        upto = min(self.num_skipped_tokens(num_computed_tokens) // self.block_size, len(st.tables[0]))
        start = st.num_skipped
        if upto <= start:
            return
        null = self.null_block
        freed: list[KVCacheBlock] = []
        n = upto - start
        for table, ids in zip(st.tables, st.ids):
            dead = table[start:upto]
            dead.reverse()  # tail-most first
            freed.extend([b for b in dead if not b.is_null])
            table[start:upto] = [null] * n
            ids[start:upto] = [0] * n
        st.num_skipped = upto
        self.pool.free_blocks(freed)

    def pop_blocks(self, request_id: str) -> list[list[KVCacheBlock]] | None:
        """Forget the request; its non-null blocks per group, tail-most first (None if unknown)."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        skip = st.num_skipped
        return [[b for b in reversed(table[skip:]) if not b.is_null] for table in st.tables]

    def free(self, request_id: str) -> None:
        groups = self.pop_blocks(request_id)
        if groups is None:
            raise UnknownRequestError(f"request {request_id!r} has no blocks to free")
        for blocks in groups:
            self.pool.free_blocks(blocks)

    # ------------------------------------------------------------ inspection
    def get_blocks(self, request_id: str) -> GroupBlocks:
        return self.state(request_id).tables

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return self.state(request_id).ids

    def check_invariants(self, ref_counts: dict[int, int]) -> None:
        """Check every table and add its block references to ``ref_counts``."""
        for rid, st in self.requests.items():
            lengths = {len(t) for t in st.tables}
            if len(lengths) != 1:
                raise InvariantViolation(f"{type(self).__name__}: request {rid!r} tables differ in length: {lengths}")
            (length,) = lengths
            if not 0 <= st.num_skipped <= length or not 0 <= st.num_cached <= length:
                raise InvariantViolation(
                    f"request {rid!r}: skipped {st.num_skipped} / cached {st.num_cached} outside table of {length}"
                )
            for table, ids in zip(st.tables, st.ids):
                if [b.block_id for b in table] != ids:
                    raise InvariantViolation(f"request {rid!r}: block id list out of sync with its table")
                for i, block in enumerate(table):
                    if block.is_null:
                        if i >= st.num_skipped:
                            raise InvariantViolation(f"request {rid!r}: null block at {i} past the skipped prefix")
                        continue
                    if i < st.num_skipped:
                        raise InvariantViolation(f"request {rid!r}: live block {block.block_id} in the skipped prefix")
                    ref_counts[block.block_id] = ref_counts.get(block.block_id, 0) + 1
