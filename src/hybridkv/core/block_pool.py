"""The block pool: every KV cache block, the free queue (which is the LRU) and the
prefix-cache map shared by all KV cache groups.

Life of a block::

    free (uncached) ──get_new_blocks──▶ used (ref_cnt ≥ 1) ──cache_full_blocks──▶ used + cached
          ▲                                   │                                       │
          └──────── evicted on reuse ◀── free + cached ◀──────free_blocks (ref 0)─────┘
                                             │ touch (a prefix hit) ─▶ used + cached

Block 0 is the *null block*: it stands in a block table for tokens no future token
attends to. It is never in the free queue, never cached and never freed.

Eviction order. The free queue (:class:`FreeBlockQueue`, O(1) per operation) is an
LRU of cached free blocks behind stacks of uncached ones; blocks are taken from its
head. A freed block that holds a cached prefix goes to the LRU's tail, a freed block
with no hash to the head, so a cached block is never evicted while an uncached free
block exists. A request frees its blocks tail-most first, so its deepest (least
shareable) blocks are evicted first. Example: a request with blocks [5(cached)
6(cached) 7(partial)] freed onto the queue [3] gives [7, 3, 6, 5]: 7 is reused first,
then 3, then 6 before 5. With ``uncached_first=False`` the queue is plain LRU as in
vLLM: [3, 7, 6, 5].

Stripes. k KV cache groups with one spec (Llama-4-Scout's three chunked groups)
advance in lock-step: at every position of a request each holds one block, and they
are allocated, cached, hit, touched and freed together. The pool lets such groups hold
a *stripe*: k blocks that share one reference count, one free-queue entry and one
prefix-cache entry, all kept on the stripe's *lead* (the block of the first group),
which lists the members; the other members (*followers*) are reached only through it.
Stripes are made and unmade on allocation: a request of one group that pops a free
stripe takes its members as plain blocks, a striped request that pops plain blocks
binds k of them into a stripe. Counts are always in blocks (a free stripe of 3 is 3
free blocks). A fresh pool starts bound into stripes of the widest striped group, and
free uncached entries are kept by width, so plain requests take plain blocks and
striped ones stripes; cached entries, evicted in LRU order, are unmade or bound as
needed. Example (groups 1-3 striped, a fresh pool of 8: stripes (1, 2, 3), (4, 5, 6)
and plain 7): ``get_new_blocks(2)`` takes 7, then unmakes (1, 2, 3), takes 1 and keeps
2 and 3 as free plain blocks (reused first); ``get_new_stripes(1, 3)`` takes stripe
(4, 5, 6) whole.
"""

from __future__ import annotations

from operator import attrgetter, length_hint
from typing import Iterable, Sequence

from hybridkv.core.blocks import NULL_BLOCK_ID, FreeBlockQueue, KVCacheBlock, bind_stripes, unmake_stripe
from hybridkv.core.events import AllBlocksCleared, KVCacheEvent
from hybridkv.core.hashing import BlockHash
from hybridkv.core.pool_invariants import check_block_pool_invariants
from hybridkv.core.prefix_cache_map import PrefixCacheMap
from hybridkv.core.usage import usable_blocks
from hybridkv.errors import InvalidArgumentError, InvariantViolation

__all__ = ["KVCacheBlock", "FreeBlockQueue", "BlockPool", "NULL_BLOCK_ID"]

_HASH = attrgetter("block_hash")


class BlockPool(PrefixCacheMap):
    """``num_blocks`` blocks (id 0 the null block) shared by ``num_groups`` KV cache groups.

    The prefix-cache map is keyed by (block hash, group id): one dict per group, so a
    block cached for group 1 is never returned for group 0. Striped groups (see the
    module docstring) share their lead group's dict: it maps a hash to a stripe lead.
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        *,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        group_kinds: Sequence[str] | None = None,
        group_spans: Sequence[int | None] | None = None,
        uncached_first: bool = True,
        block_size: int = 0,
    ):
        if type(num_blocks) is not int or num_blocks < 2:
            raise InvalidArgumentError(f"a block pool needs an int of at least 2 blocks (null + 1), got {num_blocks!r}")
        if type(num_groups) is not int or num_groups < 1:
            raise InvalidArgumentError(f"num_groups must be an int >= 1, got {num_groups!r}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.uncached_first = uncached_first
        self.block_size = block_size  # only reported in events
        # per group, only reported in events: attention kind, window / chunk size
        self.group_kinds = tuple(group_kinds) if group_kinds is not None else ("?",) * num_groups
        self.group_spans = tuple(group_spans) if group_spans is not None else (None,) * num_groups
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1  # held by the pool forever
        self.free_queue = FreeBlockQueue(self.blocks[1:], uncached_first=uncached_first)
        self._num_free = num_blocks - 1  # in blocks (a free stripe of k counts k)
        # per group: block hash -> block, or {block_id: block} when several blocks hold one hash
        self._cached: list[dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]
        # striped groups: lead group -> all its groups; group -> (lead group, index in the stripe)
        self._stripe_groups: dict[int, tuple[int, ...]] = {}
        self._member_of: list[tuple[int, int]] = [(g, 0) for g in range(num_groups)]
        self._events: list[KVCacheEvent] = []
        #: bumped whenever cached blocks lose their content address (eviction, reset): a
        #: prefix hit found at an unchanged epoch still holds what it was found under
        self.cache_epoch = 0

    def stripe_groups(self, group_ids: Sequence[int]) -> None:
        """Let ``group_ids`` (one spec, lock-step) hold stripes; group_ids[0] is the lead group."""
        group_ids = tuple(group_ids)
        if len(group_ids) < 2 or len(set(group_ids)) != len(group_ids):
            raise InvalidArgumentError(f"a stripe needs two or more distinct groups, got {group_ids}")
        for j, g in enumerate(group_ids):
            if not 0 <= g < self.num_groups or self._member_of[g] != (g, 0) or g in self._stripe_groups:
                raise InvalidArgumentError(f"group {g} is unknown or already striped")
        self._stripe_groups[group_ids[0]] = group_ids
        for j, g in enumerate(group_ids):
            self._member_of[g] = (group_ids[0], j)
        if self._num_free == self.num_blocks - 1 and not any(self._cached):  # a fresh pool
            self.free_queue.preform(self.blocks[1:], max(len(g) for g in self._stripe_groups.values()))

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        usable = usable_blocks(self.num_blocks)
        return (usable - self._num_free) / usable

    @property
    def num_cached_blocks(self) -> int:
        return sum(b.width for b in self.blocks if b.block_hash is not None)

    # ---------------------------------------------------------------- mutation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` plain blocks (evicting their cache): uncached ones first,
        then the LRU from its head.

        A free stripe taken here is unmade: its members serve as plain blocks, and
        those not needed are kept as uncached plain blocks, reused first.
        """
        if type(num_blocks) is not int or not 0 <= num_blocks <= self._num_free:
            raise InvalidArgumentError(f"asked for {num_blocks!r} blocks, only {self._num_free} free")
        fq = self.free_queue
        new = fq.pop_stack(1, num_blocks)
        if len(new) < num_blocks:
            new += self._loose(num_blocks - len(new), 1)
        for block in new:
            block.ref_cnt = 1
        self._num_free -= num_blocks
        return new

    def get_new_stripes(self, num_stripes: int, width: int) -> list[KVCacheBlock]:
        """Take ``num_stripes`` stripes of ``width`` blocks (``width * num_stripes`` blocks);
        returns their leads (plain blocks when width is 1).

        Uncached free stripes of this width come first, whole. The rest is bound
        from plain blocks: uncached ones, members of unmade uncached stripes, then
        the LRU's entries from its head (cached stripes of this width whole, the
        others unmade). New stripe i of m has members blocks[i], blocks[m + i], ...
        """
        if type(width) is not int or width < 1 or type(num_stripes) is not int or num_stripes < 0:
            raise InvalidArgumentError(f"asked for {num_stripes!r} stripes of width {width!r}")
        if width == 1:
            return self.get_new_blocks(num_stripes)
        need = num_stripes * width
        if need > self._num_free:
            raise InvalidArgumentError(f"asked for {need} blocks, only {self._num_free} free")
        leads = self.free_queue.pop_stack(width, num_stripes)
        if len(leads) < num_stripes:
            loose = self._loose((num_stripes - len(leads)) * width, width, leads)
            m = num_stripes - len(leads)
            if m:
                bind_stripes(loose, m, width)
                leads += loose[:m]
        for lead in leads:
            lead.ref_cnt = 1
        self._num_free -= need
        return leads

    def _loose(self, need: int, width: int, leads: list[KVCacheBlock] | None = None) -> list[KVCacheBlock]:
        """Plain blocks to serve ``need`` blocks of a request of ``width``: uncached plain
        blocks, members of uncached stripes of other widths, then LRU entries from the
        head (evicted). For a striped request (``leads`` given) an LRU stripe of its
        width joins ``leads`` whole, and fewer plain blocks are returned."""
        fq = self.free_queue
        loose = fq.pop_stack(1, need)
        for w in sorted(fq.stacks):
            if len(loose) >= need:
                break
            if w == 1 or w == width:
                continue
            st = fq.stacks[w]
            while st and len(loose) < need:
                members = unmake_stripe(st.pop())
                take = need - len(loose)
                loose += members[:take]
                fq.stash(members[take:])
        if len(loose) >= need:
            return loose
        units, widths, got = self._pop_units(need - len(loose), width)
        tail: tuple[KVCacheBlock, ...] = ()
        if got > need - len(loose):  # the last entry is a stripe only partly needed
            tail = unmake_stripe(units.pop())
            widths.pop()
            got -= len(tail)
        if widths.count(1) == len(units):
            loose += units
        else:
            for block in units:
                w = block.width
                if w == width and leads is not None:
                    leads.append(block)
                    need -= w
                elif w == 1:
                    loose.append(block)
                else:
                    loose.extend(unmake_stripe(block))
        take = need - len(loose)
        loose.extend(tail[:take])
        fq.stash(tail[take:])
        return loose

    def _pop_units(self, need: int, guess: int) -> tuple[list[KVCacheBlock], list[int], int]:
        """LRU entries holding at least ``need`` blocks (see :meth:`FreeBlockQueue.pop_lru`),
        their cache evicted; (entries, their widths, blocks they hold)."""
        units, widths, got = self.free_queue.pop_lru(need, guess)
        if any(map(_HASH, units)):
            self._evict_all(units)
        return units, widths, got

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks (or stripe leads), reviving free ones.

        A block that is neither held nor free (a stripe's follower, another pool's
        block) raises InvalidArgumentError; the blocks before it are released again
        (revived ones to the LRU's tail).
        """
        fq = self.free_queue
        pop = fq.lru.pop
        revived = 0  # blocks taken out of the free queue
        blocks = blocks if type(blocks) is list else list(blocks)
        it = iter(blocks)
        for block in it:
            if block.ref_cnt == 0:
                if block.is_null:
                    continue
                if pop(block.block_id, None) is None:
                    try:
                        fq.take(block)
                    except ValueError:
                        self._num_free -= revived
                        done = blocks[:len(blocks) - length_hint(it) - 1]
                        self.free_blocks(done[::-1])
                        raise InvalidArgumentError(f"block {block.block_id} is not free: cannot touch it") from None
                revived += block.width
            elif block.is_null:
                continue
            block.ref_cnt += 1
        self._num_free -= revived

    def refresh(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Move the free cached ones of ``blocks`` (plain blocks or stripe leads) to the LRU's
        tail, in the order given: they become the last cached blocks to be evicted. Held,
        null and uncached blocks are left alone; no reference is taken. Returns how many
        entries moved. LRU head [a, b, c, d], refresh([b, a]) -> [c, d, b, a]."""
        q = self.free_queue.lru
        move = q.move_to_end
        moved = 0
        for block in blocks:
            if block.ref_cnt == 0 and block.block_id in q and q[block.block_id] is block:
                move(block.block_id)
                moved += 1
        return moved

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block (or stripe lead); those reaching 0 are free:
        uncached ones reused first, cached ones to the LRU tail in the order given.
        Pass a request's blocks tail-most first (they are then evicted first).

        A block freed more often than taken raises InvariantViolation, nothing freed.
        """
        fq = self.free_queue
        q = fq.lru
        stacks = fq.stacks if fq.uncached_first else None
        freed = 0
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        it = iter(blocks)
        for block in it:
            ref = block.ref_cnt - 1
            if ref == 0:
                if block.is_null:  # its ref_cnt stays 1
                    continue
                block.ref_cnt = 0
                if stacks is not None and block.block_hash is None:
                    stacks[block.width].append(block)
                else:
                    q[block.block_id] = block
                freed += block.width
            elif block.is_null:
                continue
            else:
                block.ref_cnt = ref
                if ref > 0:
                    continue
                self._num_free += freed - self.free_queue.take_back(blocks[:len(blocks) - length_hint(it)])
                raise InvariantViolation(f"block {block.block_id} freed more often than it was taken")
        self._num_free += freed

    def uncache(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Forget the content address of held blocks (or stripe leads) whose content was never
        written (KV events: BlockRemoved); they stay held. A free block raises
        InvalidArgumentError, nothing changed (the free queue orders cached and uncached ones
        apart: free it after)."""
        blocks = list(blocks)
        if any(b.ref_cnt < 1 or b.is_null for b in blocks):
            raise InvalidArgumentError("only held blocks can be uncached")
        self._evict_all(blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use."""
        if self._num_free != self.num_blocks - 1:
            return False
        self.cache_epoch += 1
        for group in self._cached:
            group.clear()
        fq = self.free_queue
        cached = list(fq.lru.values())
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
        if fq.uncached_first:
            fq.lru.clear()
            for block in cached:
                fq.put(block)
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # -------------------------------------------------------------- invariants
    def check_invariants(self, expected_ref_counts: dict[int, int] | None = None) -> None:
        """Raise InvariantViolation if the pool is inconsistent.

        ``expected_ref_counts`` (block id -> number of block-table entries holding it,
        from the managers) must match every non-null block's ref_cnt when given (a
        follower's entries must match its lead's ref_cnt).
        """
        check_block_pool_invariants(self, expected_ref_counts)
