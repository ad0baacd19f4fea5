import pytest

from hybridkv.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from hybridkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from hybridkv.errors import InvalidArgumentError, InvariantViolation

from tests.support.kv_specs import ids


def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4
    assert pool.free_queue.block_ids() == [1, 2, 3, 4]
    pool.free_blocks([pool.null_block])  # ignored
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_free_queue_keeps_uncached_on_stacks_and_cached_in_lru_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    assert q.pop_stack(1, 2) == [blocks[0], blocks[1]]
    blocks[0].block_hash = b"h"
    q.put(blocks[0])  # cached: LRU tail
    q.put(blocks[1])  # uncached: on top of the stack
    assert q.block_ids() == [1, 2, 3, 4, 0] and blocks[0] in q
    q.take(blocks[0])
    assert q.block_ids() == [1, 2, 3, 4] and blocks[0] not in q
    plain = FreeBlockQueue(blocks, uncached_first=False)  # one LRU, in order
    assert plain.block_ids() == [0, 1, 2, 3, 4] and not plain.stacks[1]
    plain.lru_front([blocks[4]])
    assert plain.block_ids() == [4, 0, 1, 2, 3]


def test_get_new_blocks_takes_from_head_and_refcounts():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 2
    with pytest.raises(InvalidArgumentError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    pool.check_invariants({1: 1, 2: 1, 3: 1})
    with pytest.raises(InvariantViolation):
        pool.check_invariants({1: 2, 2: 1, 3: 1})


def test_uncached_blocks_are_evicted_before_cached_ones():
    # request holds [1 (cached) 2 (cached) 3 (partial)]; frees tail-most first
    pool = BlockPool(6)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, [b"h0", b"h1"], 0, 2, 0)
    pool.free_blocks(reversed(b))
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 1]
    # the next allocations use 3, 4, 5 before touching the cached 2 and 1
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    assert pool.lookup(b"h1", 0) is b[1]
    # now eviction: 2 (deeper) before 1
    got = pool.get_new_blocks(1)
    assert ids(got) == [2]
    assert pool.lookup(b"h1", 0) is None and pool.lookup(b"h0", 0) is b[0]
    pool.check_invariants()


def test_plain_lru_order_when_asked():
    pool = BlockPool(6, uncached_first=False)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, [b"h0", b"h1"], 0, 2, 0)
    pool.free_blocks(reversed(b))
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1]


def test_cache_map_is_per_group_and_touch_revives_free_blocks():
    pool = BlockPool(8, num_groups=2)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b[:1], [b"h"], 0, 1, 0)
    pool.cache_full_blocks(b[1:], [b"h"], 0, 1, 1)
    assert pool.get_cached_block(b"h", [0, 1]) == b
    assert pool.get_cached_block(b"h", [0]) == [b[0]]
    assert pool.get_cached_block(b"x", [0, 1]) is None
    pool.free_blocks(b)
    assert pool.num_free_blocks == 7
    pool.touch(b)
    assert pool.num_free_blocks == 5 and [x.ref_cnt for x in b] == [1, 1]
    pool.touch(b)  # a second request shares them
    assert [x.ref_cnt for x in b] == [2, 2]
    pool.check_invariants({b[0].block_id: 2, b[1].block_id: 2})


def test_duplicate_hashes_keep_both_blocks_reachable():
    pool = BlockPool(8)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], 0, 1, 0)
    pool.cache_full_blocks([b], [b"h"], 0, 1, 0)
    pool.check_invariants()
    pool.free_blocks([a, b])
    # uncached ones first: 3..7, then a, b; take everything up to a
    pool.get_new_blocks(5 + 1)
    assert pool.lookup(b"h", 0) is b
    pool.check_invariants()


def test_free_more_than_taken_is_an_invariant_violation():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(InvariantViolation):
        pool.free_blocks([b])


def test_reset_prefix_cache_refused_while_in_use_and_emits_event():
    pool = BlockPool(4, enable_kv_events=True, group_kinds=["full_attention"], block_size=4)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, [b"h0", b"h1"], 0, 2, 0, [5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert not pool.reset_prefix_cache()
    pool.free_blocks(reversed(b))
    assert pool.reset_prefix_cache()
    assert pool.lookup(b"h0", 0) is None and pool.num_cached_blocks == 0
    events = pool.take_events()
    assert events[0] == BlockStored((b"h0", b"h1"), (1, 2), None, 4, 0, "full_attention", (5, 6, 7, 8, 9, 10, 11, 12), None)
    assert events[-1] == AllBlocksCleared()
    assert pool.take_events() == []


def test_eviction_emits_block_removed():
    pool = BlockPool(3, enable_kv_events=True, group_kinds=["sliding_window"])
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [b"h"], 0, 1, 0)
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.take_events()[-1] == BlockRemoved(b"h", 1, 0, "sliding_window")


def test_usage_and_counts():
    pool = BlockPool(11)
    pool.get_new_blocks(5)
    assert pool.usage == 0.5


def test_invariants_catch_corruption():
    pool = BlockPool(4)
    pool.blocks[2].ref_cnt = 1  # free block with a reference
    with pytest.raises(InvariantViolation):
        pool.check_invariants()
    with pytest.raises(InvalidArgumentError):
        BlockPool(1)


def test_stripes_docstring_example():
    pool = BlockPool(8, num_groups=4)
    pool.stripe_groups((1, 2, 3))
    # fresh: stripes (1, 2, 3), (4, 5, 6), plain 7; plain uncached blocks are reused first
    assert pool.free_queue.block_ids() == [7, 1, 4] and pool.num_free_blocks == 7
    assert ids(pool.get_new_blocks(2)) == [7, 1]
    assert pool.free_queue.block_ids() == [2, 3, 4]
    (lead,) = pool.get_new_stripes(1, 3)
    assert ids(lead.stripe) == [4, 5, 6] and lead.ref_cnt == 1
    assert pool.free_queue.block_ids() == [2, 3] and pool.num_free_blocks == 2
    pool.check_invariants({7: 1, 1: 1, 4: 1, 5: 1, 6: 1})
    with pytest.raises(InvalidArgumentError):  # a stripe of 3 needs 3 free blocks
        pool.get_new_stripes(1, 3)
    assert pool.num_free_blocks == 2
    pool.free_blocks([lead])  # uncached: one entry of 3 blocks
    assert pool.free_queue.block_ids() == [2, 3, 4] and pool.num_free_blocks == 5
    pool.check_invariants({7: 1, 1: 1})


def test_free_stripes_are_reused_whole_and_plain_blocks_bound():
    pool = BlockPool(8, num_groups=3)
    pool.stripe_groups((1, 2))
    assert pool.free_queue.block_ids() == [7, 1, 3, 5]
    leads = pool.get_new_stripes(3, 2)
    assert [ids(l.stripe) for l in leads] == [[1, 2], [3, 4], [5, 6]]
    pool.free_blocks(reversed(leads))  # uncached: on the stack, the last freed on top
    assert pool.free_queue.block_ids() == [7, 1, 3, 5]
    leads = pool.get_new_stripes(2, 2)
    assert [ids(l.stripe) for l in leads] == [[1, 2], [3, 4]] and pool.free_queue.block_ids() == [7, 5]
    pool.free_blocks(leads)
    assert pool.free_queue.block_ids() == [7, 3, 1, 5]
    # a plain request takes plain 7, then unmakes the top stripe (3, 4)
    assert ids(pool.get_new_blocks(3)) == [7, 3, 4]
    assert pool.free_queue.block_ids() == [1, 5]
    (a,) = pool.get_new_stripes(1, 2)
    (b,) = pool.get_new_stripes(1, 2)
    assert ids(a.stripe) == [1, 2] and ids(b.stripe) == [5, 6] and pool.num_free_blocks == 0
    # no free stripe left: plain blocks are bound into one, in the order they come
    pool.free_blocks([pool.blocks[7], pool.blocks[3], pool.blocks[4]])
    (c,) = pool.get_new_stripes(1, 2)
    assert ids(c.stripe) == [4, 3] and pool.free_queue.block_ids() == [7]
    pool.check_invariants({1: 1, 2: 1, 5: 1, 6: 1, 4: 1, 3: 1})


def test_cached_stripe_is_one_entry_for_all_its_groups():
    pool = BlockPool(10, num_groups=3, enable_kv_events=True, group_kinds=["full", "chunked", "chunked"])
    pool.stripe_groups((1, 2))
    leads = pool.get_new_stripes(2, 2)
    assert [ids(l.stripe) for l in leads] == [[1, 2], [3, 4]]
    pool.cache_full_blocks(leads, [b"h0", b"h1"], 0, 2, 1)
    events = pool.take_events()
    assert [(e.group_id, e.block_ids) for e in events] == [(1, (1, 3)), (2, (2, 4))]
    assert pool.lookup(b"h1", 2) is pool.blocks[4] and pool.num_cached_blocks == 4
    pool.free_blocks(reversed(leads))
    assert pool.free_queue.block_ids()[-2:] == [3, 1]  # cached: to the LRU tail, deepest first
    # a plain request uses the uncached blocks, then evicts the LRU head, stripe (3, 4), as one unit
    got = pool.get_new_blocks(7)
    assert ids(got) == [9, 5, 6, 7, 8, 3, 4]
    assert pool.lookup(b"h1", 1) is None and pool.lookup(b"h0", 2) is pool.blocks[2]
    assert [(e.block_id, e.group_id) for e in pool.take_events()] == [(3, 1), (4, 2)]
    pool.check_invariants({b.block_id: 1 for b in got})


def test_bind_and_pop_lru_docstring_examples():
    from hybridkv.core.blocks import bind_stripes

    b = [KVCacheBlock(i) for i in range(12)]
    bind_stripes([b[4], b[3], b[9], b[8]], 2, 2)
    assert ids(b[4].stripe) == [4, 9] and ids(b[3].stripe) == [3, 8] and b[9].stripe is None
    q = FreeBlockQueue(uncached_first=False)
    q.preform(b[1:11], 3)
    assert q.block_ids() == [1, 4, 7, 10] and ids(b[7].stripe) == [7, 8, 9]
    units, widths, got = q.pop_lru(4, 3)
    assert ids(units) == [1, 4] and widths == [3, 3] and got == 6 and q.block_ids() == [7, 10]
    # guessing stripes where plain blocks are: more rounds, nothing given back
    q.lru_front([b[11], b[0]])
    units, widths, got = q.pop_lru(4, 3)
    assert ids(units) == [11, 0, 7] and got == 5 and q.block_ids() == [10]


def test_stored_events_split_at_null_and_cached_blocks():
    """One BlockStored per run of consecutive newly cached blocks, each with its own
    parent hash and tokens; the group's window rides along."""
    pool = BlockPool(8, enable_kv_events=True, group_kinds=["sliding_window"], group_spans=[3], block_size=2)
    b = pool.get_new_blocks(4)
    pool.cache_full_blocks([b[0]], [b"h0"], 0, 1, 0)  # block 0 cached before
    pool.take_events()
    table = [b[0], pool.null_block, b[1], b[2], pool.null_block, b[3]]
    hashes = [f"h{i}".encode() for i in range(6)]
    tokens = list(range(100, 112))
    pool.cache_full_blocks(table, hashes, 0, 6, 0, tokens)
    assert pool.take_events() == [
        BlockStored((b"h2", b"h3"), (b[1].block_id, b[2].block_id), b"h1", 2, 0, "sliding_window",
                    (104, 105, 106, 107), 3),
        BlockStored((b"h5",), (b[3].block_id,), b"h4", 2, 0, "sliding_window", (110, 111), 3),
    ]


def test_no_events_recorded_when_off():
    pool = BlockPool(4, block_size=2)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, [b"h0", b"h1"], 0, 2, 0, [1, 2, 3, 4])
    pool.free_blocks(b)
    pool.get_new_blocks(3)
    assert pool.reset_prefix_cache() is False and pool.take_events() == []
