"""A KV cache block and the free queue that orders free blocks for reuse (the LRU).

Used by :mod:`hybridkv.core.block_pool`, which explains blocks' life, eviction order
and stripes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, defaultdict
from itertools import accumulate
from operator import attrgetter
from typing import Iterable, Iterator, Sequence

from hybridkv.core.hashing import BlockHash

__all__ = ["KVCacheBlock", "FreeBlockQueue", "NULL_BLOCK_ID", "bind_stripes", "unmake_stripe"]

NULL_BLOCK_ID = 0

_WIDTH = attrgetter("width")


class KVCacheBlock:
    """One block: its id, how many requests use it, and (if cached) its hash and group.

    A stripe lead has ``stripe`` (its members, itself first) and ``width`` k; the
    other members (followers) keep ref_cnt 0, no hash and no queue entry: the lead
    holds them for the whole stripe.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "is_null", "width", "stripe")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = -1
        self.is_null = False
        self.width = 1
        self.stripe: tuple[KVCacheBlock, ...] | None = None

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}@g{self.group_id}" if self.block_hash else ""
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


def bind_stripes(blocks: list[KVCacheBlock], m: int, width: int) -> None:
    """Make stripes i = (blocks[i], blocks[m + i], ..., blocks[(width - 1) * m + i]), i < m.

    Example: blocks [4, 3, 9, 8], m 2, width 2 → stripes (4, 9) and (3, 8).
    """
    if width < 2:
        return
    for lead, members in zip(blocks, zip(*[blocks[j * m:(j + 1) * m] for j in range(width)])):
        lead.stripe = members
        lead.width = width


def unmake_stripe(lead: KVCacheBlock) -> tuple[KVCacheBlock, ...]:
    """Turn a free, uncached stripe back into plain blocks; its members."""
    members = lead.stripe
    lead.stripe = None
    lead.width = 1
    return members


class FreeBlockQueue:
    """Free entries (a plain block, or a stripe lead standing for its stripe) in reuse order.

    Two parts, both O(1) per operation:

    * ``stacks``: with ``uncached_first``, uncached entries by width, most recently
      freed on top. An uncached block holds nothing worth keeping, so it is reused
      before any cached one is evicted, and a request takes the width it needs;
    * ``lru``: an LRU of cached entries of every width (CPython's ``OrderedDict``,
      a doubly-linked list in C: append, pop from either end, removal of any
      entry), head evicted first. One LRU over all groups: per-width LRUs were
      tried and lost hits (a group's blocks outlived the blocks they pair with).

    With ``uncached_first=False`` every entry goes to the LRU: plain LRU, as in
    vLLM. Reuse order (``block_ids``): plain uncached blocks, uncached stripes
    (widths ascending), then the LRU from its head.
    """

    __slots__ = ("lru", "stacks", "uncached_first")

    def __init__(self, blocks: Iterable[KVCacheBlock] = (), uncached_first: bool = True):
        self.uncached_first = uncached_first
        self.stacks: defaultdict[int, list[KVCacheBlock]] = defaultdict(list)
        self.lru: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.clear()
        blocks = list(blocks)
        if uncached_first:
            self.stacks[1] = blocks[::-1]  # the first block on top
        else:
            self.lru.update((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self.lru) + sum(map(len, self.stacks.values()))

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for width in sorted(self.stacks):
            yield from reversed(self.stacks[width])
        yield from self.lru.values()

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self.lru or any(block in st for st in self.stacks.values())

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]

    def put(self, block: KVCacheBlock) -> None:
        """A block (or stripe lead) just freed: uncached on its stack, cached to its LRU's tail."""
        if self.uncached_first and block.block_hash is None:
            self.stacks[block.width].append(block)
        else:
            self.lru[block.block_id] = block

    def stash(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Uncached plain blocks to be reused first, blocks[0] first."""
        if self.uncached_first:
            self.stacks[1].extend(reversed(blocks))
        else:
            self.lru_front(blocks)

    def lru_front(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Entries put back at the head of the LRU, blocks[0] first."""
        q = self.lru
        for block in reversed(blocks):
            q[block.block_id] = block
            q.move_to_end(block.block_id, last=False)

    def take(self, block: KVCacheBlock) -> None:
        """Remove a free entry (a prefix hit revives it)."""
        q = self.lru
        if block.block_id in q:
            del q[block.block_id]
        else:
            self.stacks[block.width].remove(block)  # an uncached entry: not a hit, kept for safety

    def take_back(self, done: list[KVCacheBlock]) -> int:
        """Undo a free of ``done`` that failed at done[-1] (its ref_cnt fell to -1):
        references restored, entries it queued taken out again; returns their blocks."""
        done[-1].ref_cnt += 1
        taken = 0
        for block in reversed(done[:-1]):
            if block.is_null:
                continue
            if block.ref_cnt == 0:  # freed by that call
                self.take(block)
                taken += block.width
            block.ref_cnt += 1
        return taken

    def pop_stack(self, width: int, n: int) -> list[KVCacheBlock]:
        """Up to n uncached entries of ``width``, top first."""
        st = self.stacks[width]
        if n >= len(st):
            out = st[::-1]
            st.clear()
            return out
        out = st[-n:]
        del st[-n:]
        out.reverse()
        return out

    def clear(self) -> None:
        self.lru.clear()
        self.stacks.clear()
        self.stacks[1] = []

    def preform(self, blocks: list[KVCacheBlock], width: int) -> None:
        """Refill the queue with ``blocks`` (all free, uncached) bound into stripes of
        ``width``, the rest plain: a striped allocation on a fresh pool then takes one
        entry per position, and a plain one a stripe's members as plain blocks.
        Width 3, blocks 1-10: stripes (1, 2, 3), (4, 5, 6), (7, 8, 9), plain 10.
        """
        for block in blocks:
            block.stripe = None
            block.width = 1
        n = len(blocks) // width
        leads = blocks[0:n * width:width]
        for i, lead in enumerate(leads):
            lead.stripe = tuple(blocks[i * width:(i + 1) * width])
            lead.width = width
        self.clear()
        if self.uncached_first:
            self.stacks[width] = leads[::-1]  # stripe (1, 2, ...) on top
            self.stacks[1] = blocks[n * width:][::-1]
        else:
            self.lru.update((b.block_id, b) for b in leads + blocks[n * width:])

    def pop_lru(self, need: int, guess: int) -> tuple[list[KVCacheBlock], list[int], int]:
        """Pop LRU entries (a stripe is one entry of its width) from the head until they
        hold at least ``need`` blocks (or the LRU is empty); (entries, their widths,
        blocks they hold). Only the last entry can hold more than is needed.

        Each round pops the deficit divided by the width last seen (``guess`` at
        first), so plain blocks and stripes both take few rounds; entries popped past
        the one that reaches ``need`` go back untouched. Example: need 4, guess 3, LRU
        [S(3), S(3), 7]: round 1 pops 2 stripes (6 blocks); the second is needed for
        its first block only, so nothing goes back → 2 entries, 6 blocks.
        """
        q = self.lru
        pop = q.popitem
        units = [pop(False)[1] for _ in range(min(-(-need // guess), len(q)))]
        widths = list(map(_WIDTH, units))
        got = sum(widths)
        while got < need and q:
            more = [pop(False)[1] for _ in range(min(-(-(need - got) // widths[-1]), len(q)))]
            units += more
            more_widths = list(map(_WIDTH, more))
            widths += more_widths
            got += sum(more_widths)
        if got > need and len(units) > 1:
            acc = list(accumulate(widths))
            cut = bisect_left(acc, need) + 1
            if cut < len(units):
                self.lru_front(units[cut:])
                del units[cut:], widths[cut:]
                got = acc[cut - 1]
        return units, widths, got
