"""Hits valid for every group; identical specs share a manager."""

from hybridkv.core.config import KVCacheConfig, KVCacheGroup
from hybridkv.core.coordinator import KVCacheCoordinator

from tests.support.kv_specs import chunked, fake_hashes, full, ids, mark_cached, sliding


def coord(*specs, num_blocks=200, **kw):
    return KVCacheCoordinator(KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs)), **kw)


def test_identical_specs_share_one_manager_full_first():
    c = coord(chunked(8192, 16), full(16), chunked(8192, 16), chunked(8192, 16))
    assert len(c.managers) == 2
    assert c.find_order[0].downward_closed
    assert c.find_order[1].group_ids == (0, 2, 3)


def test_hit_is_the_longest_prefix_valid_for_every_group():
    # block 1; full hits blocks 0-2; chunked C 2 cached everywhere -> L = 3
    c = coord(full(1), chunked(2, 1))
    h = fake_hashes(6)
    mark_cached(c.pool, h, [True, True, True, False, False, False], group=0, first_id=10)
    mark_cached(c.pool, h, [True] * 6, group=1, first_id=30)
    blocks, n = c.find_longest_cache_hit(h, 5)
    assert n == 3
    assert ids(blocks[0]) == [10, 11, 12]
    assert ids(blocks[1]) == [0, 0, 32]  # token 3's chunk starts at 2


def test_iterates_until_length_stops_shrinking():
    # block 1, max_length 7. full -> 7. chunked C 4: token 7's chunk starts at 4,
    # block 4 hits, block 5 misses -> 5. sliding W 3 needs runs of 2 blocks: at 5,
    # block 4 hits but 3 misses; run [1, 2] ends at 3 -> 3. chunked(3): chunk starts
    # at 0, blocks 0-2 hit -> 3. Nothing shrinks any more; full is cut to 3.
    c = coord(full(1), chunked(4, 1), sliding(3, 1))
    h = fake_hashes(9)
    mark_cached(c.pool, h, [True] * 9, group=0, first_id=10)
    mark_cached(c.pool, h, [True, True, True, True, True, False, True, True, True], group=1, first_id=30)
    mark_cached(c.pool, h, [True, True, True, False, True, False, True, True, True], group=2, first_id=50)
    blocks, n = c.find_longest_cache_hit(h, 7)
    assert n == 3
    assert ids(blocks[0]) == [10, 11, 12]
    assert ids(blocks[1]) == [30, 31, 32]
    assert ids(blocks[2]) == [0, 51, 52]
    # with max_length 8 the next token (8) starts a new chunk: chunked is all null and
    # sliding's rightmost run [6, 7] ends at 8 -> 8
    assert c.find_longest_cache_hit(h, 8)[1] == 8


def test_eagle_drops_a_block_and_keeps_the_hit_valid():
    # chunked C 2, block 1, [miss miss][miss miss], max_length 4: 4 null blocks.
    # EAGLE must recompute the last block; 3 would leave token 2 (chunk [2, 4)) as a
    # null block that token 3 needs -> the valid answer is 2.
    h = fake_hashes(4)
    plain = coord(chunked(2, 1))
    assert plain.find_longest_cache_hit(h, 4)[1] == 4
    eagle = coord(chunked(2, 1), use_eagle=True)
    blocks, n = eagle.find_longest_cache_hit(h, 4)
    assert n == 2 and ids(blocks[0]) == [0, 0]


def test_eagle_with_full_attention_pops_one_block():
    c = coord(full(4), use_eagle=True)
    h = fake_hashes(3)
    mark_cached(c.pool, h, [True] * 3)
    blocks, n = c.find_longest_cache_hit(h, 12)
    assert n == 8 and ids(blocks[0]) == [10, 11]


def test_caching_disabled_never_hits():
    c = coord(full(1), enable_caching=False)
    assert c.find_longest_cache_hit(fake_hashes(3), 3) == (([],), 0)


def test_free_order_is_group_by_group_tail_first():
    c = coord(full(4), chunked(8, 4), num_blocks=20)
    c.save_new_computed_blocks("r", None, 0)
    c.allocate_new_blocks("r", 8)
    assert c.get_block_ids("r") == ([1, 2], [3, 4])
    c.free("r")
    # all uncached -> each goes to the head as it is freed: 2, 1, 4, 3 -> head 3 4 1 2
    assert c.pool.free_queue.block_ids()[:4] == [3, 4, 1, 2]
    c.check_invariants()
