import pytest

from hybridkv.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from hybridkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from hybridkv.errors import InvalidArgumentError, InvariantViolation

from tests.core.helpers import ids


def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4
    assert pool.free_queue.block_ids() == [1, 2, 3, 4]
    pool.free_blocks([pool.null_block])  # ignored
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_free_queue_is_o1_linked_list_in_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert q.block_ids() == [2, 1, 3, 4, 0]
    assert q.popleft_n(2) == [blocks[2], blocks[1]]
    assert len(q) == 3 and blocks[3] in q and blocks[2] not in q


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
    pool.cache_full_blocks(b, [b"h0", b"h1"], 0, 2, 0)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(reversed(b))
    assert pool.reset_prefix_cache()
    assert pool.lookup(b"h0", 0) is None and pool.num_cached_blocks == 0
    events = pool.take_events()
    assert events[0] == BlockStored((b"h0", b"h1"), (1, 2), None, 4, 0, "full_attention")
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
