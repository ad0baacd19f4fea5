"""What every per-attention-type manager shares.

One manager serves every KV cache group of one spec. Groups with identical specs
advance in lock-step (same tokens, same block boundaries, same skipped prefix), so
the manager does the arithmetic once, and its k groups hold *stripes* (see
:mod:`hybridkv.core.block_pool`): at each position one lead block carries the
reference count, the free-queue entry and the cache entry for all k blocks.
Llama-4-Scout's three chunked groups cost one manager and one block operation
per position, not three.

Per request the manager keeps one block table, its first group's (stripe leads;
the null block stands for skipped tokens): the other groups' tables and block ids
follow from the leads' members. Shared by all its groups: ``num_cached`` (leading
blocks that already have a content address) and ``num_skipped`` (leading blocks
that have been replaced by the null block).

``tail_only`` specs (sliding window, chunked local; :mod:`hybridkv.core.specs`): a step
computing tokens ``[s, e)`` gives no block to the positions of its *gap*
(:meth:`AttentionManager.step_gap`), blocks wholly of its own new tokens that no token from
``e`` on reads; they hold the null block (the runner attends to those keys where they were
computed and stores nothing) until the next step's :meth:`~AttentionManager.remove_skipped_blocks`
makes them part of the skipped prefix. A table is then: nulls for skipped positions, blocks,
the gap's nulls, blocks (the step's tail: its last token's block at least).

A subclass defines the attention type by two methods:

* ``num_skipped_tokens(num_computed_tokens)``: how many leading tokens no future
  token attends to once ``num_computed_tokens`` are computed (the next token is at
  index ``num_computed_tokens``);
* ``longest_hit(block_hashes, max_length)``: the longest prefix of at most
  ``max_length`` tokens (whole blocks) whose KV the attention type can reuse, as
  one list of the first group's blocks (stripe leads), null blocks for tokens it
  need not see; ``find_longest_cache_hit`` gives it per group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from operator import attrgetter, itemgetter
from typing import Sequence

from hybridkv.core.block_pool import BlockPool, KVCacheBlock
from hybridkv.core.hashing import BlockHash
from hybridkv.core.managers.tables import RequestBlocks, check_table_shape, check_tables, overlap
from hybridkv.core.request import Request
from hybridkv.core.specs import CacheSpec, cdiv
from hybridkv.errors import UnknownRequestError

__all__ = ["AttentionManager", "RequestBlocks", "NEVER"]

GroupBlocks = list[list[KVCacheBlock]]

_STRIPE = attrgetter("stripe")
_ID = attrgetter("block_id")

#: a token count no request reaches
NEVER = 1 << 62


class AttentionManager(ABC):
    """Block tables of one attention type for one or more groups with an identical spec."""

    #: True when every prefix of a valid hit is also a valid hit (full attention)
    downward_closed = False
    #: the coordinator's options this type takes as keyword arguments (e.g. the state
    #: groups' ``retention_interval``)
    options: tuple[str, ...] = ()

    def __init__(self, spec: CacheSpec, group_ids: Sequence[int], pool: BlockPool, enable_caching: bool = True):
        self.spec = spec
        self.block_size = spec.block_size
        self.group_ids = tuple(group_ids)
        self.num_groups = len(self.group_ids)
        self.width = self.num_groups  # blocks per position (stripe width)
        self.pool = pool
        self.enable_caching = enable_caching
        self.null_block = pool.null_block
        #: a step stores only what later tokens read (the spec's ``tail_only``; see :meth:`step_gap`)
        self.tail_only = bool(getattr(spec, "tail_only", False))
        self.requests: dict[str, RequestBlocks] = {}
        if self.width > 1:
            pool.stripe_groups(self.group_ids)
        self._map = pool.group_map(self.group_ids[0])  # hash -> block (stripe lead)

    @classmethod
    def detached(cls, spec: CacheSpec, lookup_map: dict, null: object = None) -> "AttentionManager":
        """A manager of one group with no pool, whose hit search (``longest_hit``) reads
        ``lookup_map`` (block hash -> any value but None or a dict, e.g. a count) in place
        of a pool's prefix-cache map; positions it need not see hold ``null``. Only the
        semantics (``longest_hit``, ``num_skipped_tokens``...) may be used: nothing is
        allocated. The map is read live, so the caller keeps it up to date.

        Example (block 2, sliding W 3 → runs of 1 block)::

            m = SlidingWindowManager.detached(spec, {b"h1": 1})
            m.longest_hit([b"h0", b"h1", b"h2"], 5)   # ([None, 1], 4)
        """
        return cls(spec, (0,), _DetachedPool(lookup_map, null))

    # ------------------------------------------------------------ semantics
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no token from index ``num_computed_tokens`` on attends to."""
        return 0

    def next_skip_at(self, num_skipped_blocks: int) -> int:
        """The smallest ``num_computed_tokens`` at which more than ``num_skipped_blocks``
        leading blocks are dead (``NEVER`` for full attention)."""
        return NEVER

    def step_gap(self, num_computed_tokens: int, num_tokens: int | None) -> tuple[int, int]:
        """Block positions ``[lo, hi)`` a step computing tokens ``[num_computed_tokens, num_tokens)``
        leaves unstored under ``tail_only``: wholly its own new tokens and dead once it ends (the
        block of its last token never). ``(0, 0)``: none (not tail_only, no step end given, or
        nothing to leave).

        Example (sliding W 4, block 2, step [1, 11)): tokens before 11 - 4 + 1 = 8 are dead at
        the end, so positions [cdiv(1, 2), min(8 // 2, 10 // 2)) = [1, 4), tokens 2-7, get no
        block; the step stores token 1 (position 0, held from before) and tokens 8-10.
        """
        if not self.tail_only or num_tokens is None or num_tokens <= num_computed_tokens:
            return (0, 0)
        bs = self.block_size
        lo = cdiv(num_computed_tokens, bs)
        hi = min(self.num_skipped_tokens(num_tokens) // bs, (num_tokens - 1) // bs)
        return (lo, hi) if hi > lo else (0, 0)

    def _open_gap(self, st: RequestBlocks) -> tuple[int, int]:
        """The request's null positions past its skipped prefix ``(lo, hi)``, (0, 0) for none."""
        lo, hi = st.gap
        lo = max(lo, st.num_skipped)
        return (lo, hi) if hi > lo else (0, 0)

    @abstractmethod
    def longest_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[list[KVCacheBlock], int]:
        """(hit blocks of the first group, i.e. stripe leads and null blocks; hit length in
        tokens); the length is whole blocks, <= max_length."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[GroupBlocks, int]:
        """(per-group hit blocks, hit length in tokens); the length is whole blocks, <= max_length."""
        leads, length = self.longest_hit(block_hashes, max_length)
        return self._per_group(leads), length

    def _scan(self, block_hashes: Sequence[BlockHash], start: int, end: int) -> list[KVCacheBlock]:
        """Cached blocks (stripe leads) of positions start, start+1, ... up to the first miss before end."""
        get = self._map.get
        hits: list[KVCacheBlock] = []
        append = hits.append
        for i in range(start, end):
            hit = get(block_hashes[i])
            if hit is None:
                break
            append(next(iter(hit.values())) if type(hit) is dict else hit)
        return hits

    def _lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block (stripe lead) of ``block_hash``, or None."""
        hit = self._map.get(block_hash)
        if hit is not None and type(hit) is dict:  # several blocks hold this hash
            hit = next(iter(hit.values()))
        return hit

    def _per_group(self, leads: list[KVCacheBlock]) -> GroupBlocks:
        """One list per group from a list of leads (and null blocks): group j gets member j."""
        if self.width == 1:
            return [leads]
        if len(leads) == 1 and leads[0].stripe is not None:  # one new stripe (a decode step)
            return [[b] for b in leads[0].stripe]
        n = leads.count(self.null_block)  # null blocks lead every hit and table (not a tail_only gap)
        if self.tail_only and n and any(b.is_null for b in leads[n:]):  # a gap's nulls too
            return [leads] + [[b if b.is_null else b.stripe[j] for b in leads] for j in range(1, self.width)]
        stripes = list(map(_STRIPE, leads[n:] if n else leads))
        out = [leads]
        for j in range(1, self.width):
            members = list(map(itemgetter(j), stripes))
            out.append(leads[:n] + members if n else members)
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
        new_computed_blocks: list[KVCacheBlock] | None,
        num_computed_tokens: int,
        step_end: int | None = None,
    ) -> int:
        """Blocks the pool must hand out to give the request ``num_tokens`` slots.

        ``new_computed_blocks`` is a new request's prefix hit in this manager's first
        group (stripe leads, null blocks for skipped tokens). Counts new blocks for
        every group plus hit blocks that are free now (touching them takes them out
        of the free queue). For a new request the skipped prefix of the hit costs
        nothing: it becomes null blocks.
        Example (chunked C 8, block 4, one group, new request, hit [null null b7],
        12 computed, num_tokens 20): skipped 8 tokens = 2 blocks; 5 blocks needed,
        3 held → 2 new, plus b7 if it is free; with 3 striped groups, 3 times that.
        ``step_end`` (``tail_only``): the step computes tokens up to it; its :meth:`step_gap`
        costs nothing, and an earlier step's gap not yet skipped is filled again.
        """
        need = cdiv(num_tokens, self.block_size)
        gap = self.step_gap(num_computed_tokens, step_end)
        st = self.requests.get(request_id)
        if st is not None:
            have = len(st.blocks)
            lo, hi = self._open_gap(st)
            return (max(need - have, 0) - overlap(have, need, gap) + hi - lo) * self.width
        if not new_computed_blocks:
            return (need - overlap(0, need, gap)) * self.width
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        leads = new_computed_blocks
        first = max(skipped, len(leads))
        num_new = max(need - first, 0) - overlap(first, need, gap)
        # free hit blocks (the null block is never free: its ref_cnt stays 1)
        evictable = [b.ref_cnt for b in (leads[skipped:] if skipped else leads)].count(0)
        return (num_new + evictable) * self.width

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: list[KVCacheBlock] | None, num_computed_tokens: int
    ) -> None:
        """Start the request's tables with its prefix hit (the first group's blocks), taking references."""
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = RequestBlocks(self.num_groups)
        if not new_computed_blocks:
            return
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        kept = new_computed_blocks[skipped:]
        self.pool.touch(kept)
        st.blocks += [self.null_block] * skipped
        st.blocks += kept
        ids = st.ids[0]
        ids += [0] * skipped
        ids += [b.block_id for b in kept]
        st.num_cached = len(st.blocks)
        st.num_skipped = skipped

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                            step_end: int | None = None) -> list[KVCacheBlock]:
        """Grow the tables to cover ``num_tokens`` tokens; the new blocks (stripe leads).

        ``tail_only`` with ``step_end`` (the step computes ``[num_computed_tokens, step_end)``):
        the new positions in its :meth:`step_gap` get the null block; an earlier gap not yet
        skipped gets blocks first (the step before did not end as planned: a re-run).
        """
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = RequestBlocks(self.num_groups)
        refill = self._refill_gap(st) if st.gap != (0, 0) else []
        have = len(st.blocks)
        n = cdiv(num_tokens, self.block_size) - have
        if n <= 0:
            return refill
        lo, hi = self.step_gap(num_computed_tokens, step_end)
        lo, hi = max(lo, have), min(hi, have + n)
        num_null = max(hi - lo, 0)
        new = self._new_blocks(n - num_null)
        if num_null:
            null = self.null_block
            st.blocks += new[:lo - have] + [null] * num_null + new[lo - have:]
            st.gap = (lo, hi)
        else:
            st.blocks += new
        st.ids[0] += [b.block_id for b in st.blocks[have:]]
        return refill + new

    def _new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n <= 0:
            return []
        return self.pool.get_new_stripes(n, self.width) if self.width > 1 else self.pool.get_new_blocks(n)

    def _refill_gap(self, st: RequestBlocks) -> list[KVCacheBlock]:
        """New blocks in the request's open gap (its positions are needed again); the blocks."""
        lo, hi = self._open_gap(st)
        st.gap = (0, 0)
        if hi <= lo:
            return []
        new = self._new_blocks(hi - lo)
        st.blocks[lo:hi] = new
        st.ids[0][lo:hi] = [b.block_id for b in new]
        st.num_cached = min(st.num_cached, lo)  # the new blocks get their addresses when cached again
        if st.synced > lo:  # followers' ids from lo on are out of date
            st.synced = lo
            for ids in st.ids[1:]:
                del ids[lo:]
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Give content addresses to the request's full blocks among its first ``num_tokens`` tokens."""
        st = self.requests[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= st.num_cached:
            return
        self.pool.cache_full_blocks(
            st.blocks, request.block_hashes, st.num_cached, num_full, self.group_ids[0], request.all_token_ids
        )
        st.num_cached = num_full

    def uncache_from(self, request_id: str, first: int) -> int:
        """Take the content address from the request's blocks at positions ``first``.. (their
        K/V or state was never written: a failed step); returns how many blocks lost one.
        They stay in the tables; only prefix hits no longer find them."""
        st = self.state(request_id)
        dead = [b for b in st.blocks[first:] if b.block_hash is not None]
        if dead:
            self.pool.uncache(dead)
        st.num_cached = min(st.num_cached, first)
        return sum(b.width for b in dead)

    def freed_needed_blocks(self, request_id: str, num_computed_tokens: int) -> bool:
        """True when the token after ``num_computed_tokens`` would read a block this request
        already freed: its computed count moved back past what was skipped (W 4, block 2,
        blocks 0-1 freed at n 7; n set back to 4 needs tokens 1-3, block 0 is gone)."""
        st = self.requests.get(request_id)
        if st is None:
            return False
        dead = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        if st.num_skipped > dead:
            return True
        # tail_only: a gap token counted as computed (never stored) that the next token still reads
        lo, hi = self._open_gap(st)
        return hi > lo and num_computed_tokens > lo * self.block_size and dead < hi

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free every block wholly before ``num_skipped_tokens(num_computed_tokens)``; null in its place.

        Freed tail-most first, so the older (more shareable) prefix stays cached longer.
        """
        st = self.requests.get(request_id)
        if st is None:
            return
        upto = min(self.num_skipped_tokens(num_computed_tokens) // self.block_size, len(st.blocks))
        start = st.num_skipped
        if upto <= start:
            return
        dead = st.blocks[start:upto]  # the leads
        if st.gap != (0, 0):  # a tail_only gap's nulls
            dead = [b for b in dead if not b.is_null]
            st.gap = (0, 0) if st.gap[1] <= upto else (max(st.gap[0], upto), st.gap[1])
        dead.reverse()  # tail-most first
        st.blocks[start:upto] = [self.null_block] * (upto - start)
        st.ids[0][start:upto] = [0] * (upto - start)
        synced = min(upto, st.synced)
        if start < synced:  # followers' ids already out
            zeros = [0] * (synced - start)
            for ids in st.ids[1:]:
                ids[start:synced] = zeros
        st.num_skipped = upto
        self.pool.free_blocks(dead)

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock] | None:
        """Forget the request; its blocks (stripe leads) to free, tail-most first (None if unknown)."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        n = st.num_skipped
        blocks = st.blocks[:n - 1:-1] if n else st.blocks[::-1]
        return [b for b in blocks if not b.is_null] if st.gap != (0, 0) else blocks

    def free(self, request_id: str) -> None:
        blocks = self.pop_blocks(request_id)
        if blocks is None:
            raise UnknownRequestError(f"request {request_id!r} has no blocks to free")
        self.pool.free_blocks(blocks)

    # ------------------------------------------------------------ inspection
    def get_blocks(self, request_id: str) -> GroupBlocks:
        """The request's table of each group (new lists)."""
        return self._per_group(self.state(request_id).blocks)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids of each group (live lists, brought up to date)."""
        st = self.state(request_id)
        if st.synced < len(st.blocks):
            self._sync(st)
        return st.ids

    def _sync(self, st: RequestBlocks) -> None:
        """Bring the followers' ids up to date: positions synced.. of the lead table."""
        n = len(st.blocks)
        if self.width > 1:
            lo = max(st.synced, min(st.num_skipped, n))  # null positions before lo
            zeros = [0] * (lo - st.synced)
            if st.gap != (0, 0):  # a tail_only gap's nulls among them
                ahead = st.blocks[lo:n]
                for j, ids in enumerate(st.ids[1:], 1):
                    ids += zeros
                    ids.extend(0 if b.is_null else b.stripe[j].block_id for b in ahead)
                st.synced = n
                return
            stripes = list(map(_STRIPE, st.blocks[lo:n]))
            for j, ids in enumerate(st.ids[1:], 1):
                ids += zeros
                ids.extend(map(_ID, map(itemgetter(j), stripes)))
        st.synced = n

    def check_invariants(self, ref_counts: dict[int, int]) -> None:
        """Check every table and add its block references to ``ref_counts`` (:func:`check_tables`)."""
        check_tables(self, ref_counts)

    def _check_table_shape(self, rid: str, st: RequestBlocks) -> None:
        """Null blocks exactly at the skipped positions (the leading ones) and a tail_only gap."""
        check_table_shape(rid, st, self.tail_only)


class _DetachedPool:
    """What a manager reads from its pool at construction, for :meth:`AttentionManager.detached`."""

    __slots__ = ("null_block", "_map")

    def __init__(self, lookup_map: dict, null: object):
        self.null_block = null
        self._map = lookup_map

    def group_map(self, group_id: int) -> dict:
        return self._map
