from hybridkv.core.block_pool import BlockPool
from hybridkv.core.managers import FullAttentionManager
from hybridkv.core.request import BlockHasher, Request

from tests.core.helpers import fake_hashes, full, ids, mark_cached


def make(groups=(0,), num_blocks=50):
    pool = BlockPool(num_blocks, num_groups=len(groups))
    return pool, FullAttentionManager(full(4), groups, pool)


def test_hits_left_to_right_until_first_miss():
    pool, m = make()
    hashes = fake_hashes(5)
    mark_cached(pool, hashes, [True, True, False, True, True])
    blocks, n = m.find_longest_cache_hit(hashes, 20)
    assert ids(blocks[0]) == [10, 11] and n == 8
    blocks, n = m.find_longest_cache_hit(hashes, 7)  # caps at whole blocks
    assert ids(blocks[0]) == [10] and n == 4


def test_multi_group_hit_needs_every_group():
    pool, m = make(groups=(0, 1))
    hashes = fake_hashes(3)
    mark_cached(pool, hashes, [True, True, True], group=0, first_id=10)
    mark_cached(pool, hashes, [True, False, True], group=1, first_id=20)
    blocks, n = m.find_longest_cache_hit(hashes, 12)
    assert n == 4 and ids(blocks[0]) == [10] and ids(blocks[1]) == [20]


def test_allocate_cache_and_free_tail_first():
    pool, m = make()
    req = Request("r", list(range(10)), hasher=BlockHasher(4))
    m.save_new_computed_blocks("r", None, 0)
    assert m.get_num_blocks_to_allocate("r", 10, None, 0) == 3
    m.allocate_new_blocks("r", 10)
    m.cache_blocks(req, 10)
    assert m.get_block_ids("r") == [[1, 2, 3]]
    assert [pool.blocks[i].block_hash for i in (1, 2)] == req.block_hashes and pool.blocks[3].block_hash is None
    m.remove_skipped_blocks("r", 10)  # full attention never skips
    assert m.get_block_ids("r") == [[1, 2, 3]]
    m.free("r")
    # the partial block 3 goes to the head, cached ones to the tail, tail-most first
    assert pool.free_queue.block_ids()[0] == 3 and pool.free_queue.block_ids()[-2:] == [2, 1]
    pool.check_invariants()
