"""Sliding window W: token i attends to (i - W, i]."""

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.managers import SlidingWindowManager

from tests.support.kv_specs import fake_hashes, ids, mark_cached, sliding


def make(window, bs, groups=(0,), num_blocks=100):
    pool = BlockPool(num_blocks, num_groups=len(groups))
    return pool, SlidingWindowManager(sliding(window, bs), groups, pool)


def find(cached, max_length, window=4, bs=2):
    pool, m = make(window, bs)
    hashes = fake_hashes(len(cached))
    mark_cached(pool, hashes, cached)
    blocks, n = m.find_longest_cache_hit(hashes, max_length)
    return ids(blocks[0]), n


def test_rightmost_run_covering_window_minus_one():
    # W 4, block 2 -> the next token needs 3 earlier tokens -> runs of 2 blocks
    assert find([False, True, False, True, True, False], 12) == ([0, 0, 0, 13, 14], 10)
    assert find([True] * 6, 12) == ([0, 0, 0, 0, 14, 15], 12)
    # a run of one block is not enough in the middle ...
    assert find([False, False, True, False, False, False], 12) == ([], 0)
    # ... but a run that starts at position 0 is a hit (nothing before it is needed)
    assert find([True, False, False, True, False, False], 12) == ([10], 2)


def test_max_length_caps_the_scan():
    # blocks 4, 5 cached but max_length 8 -> only blocks 0-3 may hit
    assert find([False, False, True, True, True, True], 8) == ([0, 0, 12, 13], 8)
    assert find([True] * 6, 7) == ([0, 11, 12], 6)


def test_window_of_one_needs_nothing():
    assert find([False] * 3, 6, window=1) == ([0, 0, 0], 6)


def test_remove_skipped_blocks_frees_blocks_outside_the_window():
    # W 4, block 2: with n computed the next token n attends to (n-4, n] -> tokens
    # before n - 3 are dead. n = 7 -> 4 dead tokens -> blocks 0, 1.
    pool, m = make(4, 2)
    m.save_new_computed_blocks("r", None, 0)
    m.allocate_new_blocks("r", 9)
    assert m.get_block_ids("r")[0] == [1, 2, 3, 4, 5]
    m.remove_skipped_blocks("r", 4)  # 1 dead token: no whole block
    assert m.get_block_ids("r")[0] == [1, 2, 3, 4, 5]
    m.remove_skipped_blocks("r", 7)
    assert m.get_block_ids("r")[0] == [0, 0, 3, 4, 5]
    assert pool.free_queue.block_ids()[:2] == [1, 2]  # uncached: reused first
    m.remove_skipped_blocks("r", 9)  # 6 dead tokens -> blocks 0-2
    assert m.get_block_ids("r")[0] == [0, 0, 0, 4, 5]
    m.free("r")
    pool.check_invariants()
    assert pool.num_free_blocks == 99


def test_new_request_hit_nulls_are_not_touched():
    pool, m = make(4, 2)
    hashes = fake_hashes(6)
    mark_cached(pool, hashes, [True] * 6)
    blocks, n = m.find_longest_cache_hit(hashes, 10)
    assert ids(blocks[0]) == [0, 0, 0, 13, 14] and n == 10
    # 12 slots: 6 blocks; skipped (10 - 3) // 2 = 3, held 5 -> 1 new + 2 evictable hits
    assert m.get_num_blocks_to_allocate("r", 12, blocks[0], 10) == 3
    m.save_new_computed_blocks("r", blocks[0], 10)
    m.allocate_new_blocks("r", 12)
    assert m.get_block_ids("r")[0] == [0, 0, 0, 13, 14, 1]
    assert pool.blocks[10].ref_cnt == 0 and pool.blocks[13].ref_cnt == 1


def test_cached_skipped_blocks_go_to_the_lru_tail_tail_most_first():
    from hybridkv.core.request import BlockHasher, Request

    pool, m = make(4, 2)
    req = Request("r", list(range(9)), hasher=BlockHasher(2))
    m.save_new_computed_blocks("r", None, 0)
    m.allocate_new_blocks("r", 9)
    m.cache_blocks(req, 9)
    m.remove_skipped_blocks("r", 9)  # blocks 0-2 dead, all cached
    assert m.get_block_ids("r")[0] == [0, 0, 0, 4, 5]
    assert pool.free_queue.block_ids()[-3:] == [3, 2, 1]
    pool.check_invariants({4: 1, 5: 1})
