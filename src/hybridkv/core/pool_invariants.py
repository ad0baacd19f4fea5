"""Consistency checks of a block pool (tests call them after every step, through
:meth:`BlockPool.check_invariants <hybridkv.core.block_pool.BlockPool.check_invariants>`).

The checks read the pool through :class:`PoolState`, which :class:`~hybridkv.core.block_pool.BlockPool`
satisfies; this module does not import ``block_pool`` (``block_pool`` imports it).
"""

from __future__ import annotations

from typing import Protocol

from hybridkv.core.blocks import NULL_BLOCK_ID, FreeBlockQueue, KVCacheBlock
from hybridkv.core.hashing import BlockHash
from hybridkv.errors import InvariantViolation

__all__ = ["PoolState", "check_block_pool_invariants"]


class PoolState(Protocol):
    """What the checks read of a block pool. The underscored members are the pool's own
    bookkeeping (see :class:`~hybridkv.core.block_pool.BlockPool`), read here, never written."""

    num_blocks: int
    num_groups: int
    enable_caching: bool
    blocks: list[KVCacheBlock]
    null_block: KVCacheBlock
    free_queue: FreeBlockQueue
    #: per group: block hash -> block, or {block_id: block} when several blocks hold one hash
    _cached: list[dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]]]
    #: striped groups: lead group -> all its groups
    _stripe_groups: dict[int, tuple[int, ...]]
    #: group -> (lead group, index in the stripe)
    _member_of: list[tuple[int, int]]

    @property
    def num_free_blocks(self) -> int: ...


def check_block_pool_invariants(pool: PoolState, expected_ref_counts: dict[int, int] | None = None) -> None:
    """The checks behind :meth:`BlockPool.check_invariants`."""

    def fail(msg: str) -> None:
        raise InvariantViolation(f"block pool: {msg}")

    null = pool.null_block
    if null.block_id != NULL_BLOCK_ID or not null.is_null or null.block_hash is not None or null.stripe:
        fail("null block corrupted")
    if null in pool.free_queue:
        fail("null block is in the free queue")
    fq = pool.free_queue
    free_ids = set(fq.block_ids())
    if len(free_ids) != len(fq):
        fail("a block is twice in the free queue")
    for key, block in fq.lru.items():
        if key != block.block_id or (fq.uncached_first and block.block_hash is None):
            fail(f"LRU entry {key} is not the cached block it names")
    for width, stack in fq.stacks.items():
        for block in stack:
            if block.block_hash is not None or block.width != width:
                fail(f"uncached stack of width {width} holds block {block.block_id} (width {block.width})")
    # followers: block id -> its lead, from the leads' member lists
    lead_of: dict[int, KVCacheBlock] = {}
    for block in pool.blocks[1:]:
        if block.stripe is None:
            continue
        if len(block.stripe) < 2 or block.width != len(block.stripe) or block.stripe[0] is not block:
            fail(f"stripe lead {block.block_id} has a malformed stripe")
        for follower in block.stripe[1:]:
            if follower.block_id in lead_of or follower.is_null:
                fail(f"block {follower.block_id} is a member of two stripes (or null)")
            lead_of[follower.block_id] = block
    used = free = 0
    for block in pool.blocks[1:]:
        if block.is_null:
            fail(f"block {block.block_id} marked null")
        lead = lead_of.get(block.block_id)
        if lead is not None:  # a follower: its lead holds the count, the hash and the queue entry
            if block.stripe is not None or block.width != 1:
                fail(f"follower {block.block_id} of {lead.block_id} leads a stripe itself")
            if block.ref_cnt != 0 or block.block_hash is not None or block.block_id in free_ids:
                fail(f"follower {block.block_id} has its own ref_cnt, hash or queue entry")
            if expected_ref_counts is not None and expected_ref_counts.get(block.block_id, 0) != lead.ref_cnt:
                fail(
                    f"follower {block.block_id}: {expected_ref_counts.get(block.block_id, 0)} block-table "
                    f"entries != lead {lead.block_id} ref_cnt {lead.ref_cnt}"
                )
            continue
        width = block.width
        if block.stripe is None and width != 1:
            fail(f"plain block {block.block_id} has width {width}")
        if block.stripe is not None and block.block_hash is not None and block.group_id not in pool._stripe_groups:
            fail(f"stripe {block.block_id} cached for unstriped group {block.group_id}")
        if block.ref_cnt < 0:
            fail(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
        in_free = block.block_id in free_ids
        if in_free and block.ref_cnt != 0:
            fail(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
        if in_free:
            free += width
        else:
            if block.ref_cnt == 0:
                fail(f"block {block.block_id} has ref_cnt 0 but is not free")
            used += width
        if expected_ref_counts is not None and block.ref_cnt != expected_ref_counts.get(block.block_id, 0):
            fail(
                f"block {block.block_id} ref_cnt {block.ref_cnt} != "
                f"{expected_ref_counts.get(block.block_id, 0)} block-table entries"
            )
        if block.block_hash is not None:
            if not 0 <= block.group_id < pool.num_groups or pool._member_of[block.group_id][1] != 0:
                fail(f"cached block {block.block_id} has group {block.group_id}")
            if (block.group_id in pool._stripe_groups) != (block.stripe is not None):
                fail(f"cached block {block.block_id}: stripe and group {block.group_id} disagree")
            if block.stripe is not None and len(block.stripe) != len(pool._stripe_groups[block.group_id]):
                fail(f"cached stripe {block.block_id} has {len(block.stripe)} members for "
                     f"{len(pool._stripe_groups[block.group_id])} groups")
            entry = pool._cached[block.group_id].get(block.block_hash)
            if not (entry is block or (type(entry) is dict and entry.get(block.block_id) is block)):
                fail(f"cached block {block.block_id} missing from the hash map")
    if free != pool.num_free_blocks:
        fail(f"free queue holds {free} blocks, counted {pool.num_free_blocks}")
    if used + free + 1 != pool.num_blocks:
        fail(f"free {free} + used {used} + null 1 != total {pool.num_blocks}")
    for g, group in enumerate(pool._cached):
        if group and pool._member_of[g][1] != 0:
            fail(f"follower group {g} has its own hash map entries")
        for key, entry in group.items():
            members = entry.values() if type(entry) is dict else (entry,)
            for block in members:
                if block.block_hash != key or block.group_id != g:
                    fail(f"hash map entry of group {g} points at block {block.block_id} with another key")
            if type(entry) is dict and len(entry) < 2:
                fail(f"duplicate-hash entry of group {g} holds {len(entry)} block(s)")
    if not pool.enable_caching and any(pool._cached):
        fail("blocks cached while prefix caching is disabled")
