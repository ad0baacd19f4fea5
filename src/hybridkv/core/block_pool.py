"""The block pool: every KV cache block, the free queue (which is the LRU) and the
prefix-cache map shared by all KV cache groups.

Life of a block::

    free (uncached) ──get_new_blocks──▶ used (ref_cnt ≥ 1) ──cache_full_blocks──▶ used + cached
          ▲                                   │                                       │
          └──────── evicted on reuse ◀── free + cached ◀──────free_blocks (ref 0)─────┘
                                             │ touch (a prefix hit) ─▶ used + cached

Block 0 is the *null block*: it stands in a block table for tokens no future token
attends to. It is never in the free queue, never cached and never freed.

Eviction order. The free queue is a doubly-linked list (CPython's ``OrderedDict``,
implemented in C: O(1) append, pop from either end, and removal of any block).
Blocks are taken from the head. A freed block that holds a cached prefix goes to
the tail; a freed block with no hash is worth nothing and goes to the head, so a
cached block is never evicted while an uncached free block exists. A request frees
its blocks tail-most first, so its deepest (least shareable) blocks are evicted
first. Example: a request with blocks [5(cached) 6(cached) 7(partial)] freed onto
the queue [3] gives [7, 3, 6, 5]: 7 is reused first, then 3, then 6 before 5.
With ``uncached_first=False`` the queue is plain LRU as in vLLM: [3, 7, 6, 5].
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator, Sequence

from hybridkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from hybridkv.core.hashing import BlockHash
from hybridkv.errors import InvalidArgumentError, InvariantViolation

__all__ = ["KVCacheBlock", "FreeBlockQueue", "BlockPool", "NULL_BLOCK_ID"]

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One block: its id, how many requests use it, and (if cached) its hash and group."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = -1
        self.is_null = False

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}@g{self.group_id}" if self.block_hash else ""
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Free blocks in eviction order (head = next to reuse). All operations O(1)."""

    __slots__ = ("_q",)

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._q.values())

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._q

    def popleft(self) -> KVCacheBlock:
        return self._q.popitem(last=False)[1]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        pop = self._q.popitem
        return [pop(last=False)[1] for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        del self._q[block.block_id]

    def append(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block

    def appendleft(self, block: KVCacheBlock) -> None:
        q = self._q
        q[block.block_id] = block
        q.move_to_end(block.block_id, last=False)

    def block_ids(self) -> list[int]:
        return list(self._q)


class BlockPool:
    """``num_blocks`` blocks (id 0 the null block) shared by ``num_groups`` KV cache groups.

    The prefix-cache map is keyed by (block hash, group id): one dict per group, so a
    block cached for group 1 is never returned for group 0.
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        *,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        group_kinds: Sequence[str] | None = None,
        uncached_first: bool = True,
        block_size: int = 0,
    ):
        if num_blocks < 2:
            raise InvalidArgumentError(f"a block pool needs at least 2 blocks (null + 1), got {num_blocks}")
        if num_groups < 1:
            raise InvalidArgumentError(f"num_groups must be >= 1, got {num_groups}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.uncached_first = uncached_first
        self.block_size = block_size  # only reported in events
        self.group_kinds = tuple(group_kinds) if group_kinds is not None else ("?",) * num_groups
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1  # held by the pool forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # per group: block hash -> block, or {block_id: block} when several blocks hold one hash
        self._cached: list[dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]
        self._events: list[KVCacheEvent] = []

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        usable = self.num_blocks - 1
        return (usable - len(self.free_queue)) / usable

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.block_hash is not None)

    def get_cached_block(self, block_hash: BlockHash, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in each group, or None if any group misses."""
        out = []
        for g in group_ids:
            hit = self._cached[g].get(block_hash)
            if hit is None:
                return None
            if type(hit) is dict:
                hit = next(iter(hit.values()))
            out.append(hit)
        return out

    def group_map(self, group_id: int) -> dict:
        """Group ``group_id``'s hash map (hash -> block, or {block_id: block} for duplicates); read only."""
        return self._cached[group_id]

    def lookup(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        """The cached block of ``block_hash`` in one group (no list built)."""
        hit = self._cached[group_id].get(block_hash)
        if hit is not None and type(hit) is dict:
            hit = next(iter(hit.values()))
        return hit

    # ---------------------------------------------------------------- mutation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (evicting their cache)."""
        if num_blocks > len(self.free_queue):
            raise InvalidArgumentError(f"asked for {num_blocks} blocks, only {len(self.free_queue)} free")
        new = self.free_queue.popleft_n(num_blocks)
        for block in new:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return new

    def _evict(self, block: KVCacheBlock) -> None:
        group = self._cached[block.group_id]
        key = block.block_hash
        entry = group.get(key)
        if entry is block:
            del group[key]
        elif type(entry) is dict:
            del entry[block.block_id]
            if len(entry) == 1:
                group[key] = next(iter(entry.values()))
        if self.enable_kv_events:
            self._events.append(
                BlockRemoved(key, block.block_id, block.group_id, self.group_kinds[block.group_id])
            )
        block.block_hash = None
        block.group_id = -1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        group_id: int,
    ) -> None:
        """Give blocks[start:end] the content addresses block_hashes[start:end] in ``group_id``.

        Null blocks and blocks already cached (prefix hits) are skipped.
        """
        cached = self._cached[group_id]
        stored_ids: list[int] = []
        stored_hashes: list[BlockHash] = []
        stored_first = start
        for i in range(start, end):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = block_hashes[i]
            block.block_hash = key
            block.group_id = group_id
            entry = cached.get(key)
            if entry is None:
                cached[key] = block
            elif type(entry) is dict:
                entry[block.block_id] = block
            else:
                cached[key] = {entry.block_id: entry, block.block_id: block}
            if self.enable_kv_events:
                if not stored_ids:
                    stored_first = i
                stored_ids.append(block.block_id)
                stored_hashes.append(key)
        if stored_ids:
            first = stored_first
            self._events.append(
                BlockStored(
                    tuple(stored_hashes),
                    tuple(stored_ids),
                    block_hashes[first - 1] if first > 0 else None,
                    self.block_size,
                    group_id,
                    self.group_kinds[group_id],
                )
            )

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        queue = self.free_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in order.

        Pass a request's blocks tail-most first (they are then evicted first).
        """
        queue = self.free_queue
        uncached_first = self.uncached_first
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if uncached_first and block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
            elif block.ref_cnt < 0:
                raise InvariantViolation(f"block {block.block_id} freed more often than it was taken")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        for group in self._cached:
            group.clear()
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
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
        from the managers) must match every non-null block's ref_cnt when given.
        """

        def fail(msg: str) -> None:
            raise InvariantViolation(f"block pool: {msg}")

        null = self.null_block
        if null.block_id != NULL_BLOCK_ID or not null.is_null or null.block_hash is not None:
            fail("null block corrupted")
        if null in self.free_queue:
            fail("null block is in the free queue")
        free_ids = set(self.free_queue.block_ids())
        if len(free_ids) != len(self.free_queue):
            fail("a block is twice in the free queue")
        used = 0
        for block in self.blocks[1:]:
            if block.is_null:
                fail(f"block {block.block_id} marked null")
            if block.ref_cnt < 0:
                fail(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            in_free = block.block_id in free_ids
            if in_free and block.ref_cnt != 0:
                fail(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
            if not in_free:
                if block.ref_cnt == 0:
                    fail(f"block {block.block_id} has ref_cnt 0 but is not free")
                used += 1
            if expected_ref_counts is not None and block.ref_cnt != expected_ref_counts.get(block.block_id, 0):
                fail(
                    f"block {block.block_id} ref_cnt {block.ref_cnt} != "
                    f"{expected_ref_counts.get(block.block_id, 0)} block-table entries"
                )
            if block.block_hash is not None:
                if not 0 <= block.group_id < self.num_groups:
                    fail(f"cached block {block.block_id} has group {block.group_id}")
                entry = self._cached[block.group_id].get(block.block_hash)
                if not (entry is block or (type(entry) is dict and entry.get(block.block_id) is block)):
                    fail(f"cached block {block.block_id} missing from the hash map")
        if used + len(free_ids) + 1 != self.num_blocks:
            fail(f"free {len(free_ids)} + used {used} + null 1 != total {self.num_blocks}")
        for g, group in enumerate(self._cached):
            for key, entry in group.items():
                members = entry.values() if type(entry) is dict else (entry,)
                for block in members:
                    if block.block_hash != key or block.group_id != g:
                        fail(f"hash map entry of group {g} points at block {block.block_id} with another key")
                if type(entry) is dict and len(entry) < 2:
                    fail(f"duplicate-hash entry of group {g} holds {len(entry)} block(s)")
        if not self.enable_caching and any(self._cached):
            fail("blocks cached while prefix caching is disabled")
