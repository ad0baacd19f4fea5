from hybridkv.core.block_pool import BlockPool
from hybridkv.core.managers import FullAttentionManager
from hybridkv.core.request import BlockHasher, Request

from tests.support.kv_specs import fake_hashes, full, ids, mark_cached


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


def test_two_groups_share_stripes_and_hit_together():
    pool, m = make(groups=(0, 1))
    req = Request("r", list(range(10)), hasher=BlockHasher(4))
    m.save_new_computed_blocks("r", None, 0)
    m.allocate_new_blocks("r", 10)
    m.cache_blocks(req, 10)
    assert m.get_block_ids("r") == [[1, 3, 5], [2, 4, 6]]  # fresh stripes (1, 2), (3, 4), ...
    m.free("r")
    # one queue entry per stripe: the partial stripe 5 (uncached) with the free
    # stripes, the cached 3 and 1 at the LRU tail, deepest first
    fq = pool.free_queue.block_ids()
    assert fq[:3] == [49, 5, 7] and fq[-2:] == [3, 1]
    assert pool.num_free_blocks == 49
    blocks, n = m.find_longest_cache_hit(req.block_hashes, 9)
    assert n == 8 and ids(blocks[0]) == [1, 3] and ids(blocks[1]) == [2, 4]
    # a plain allocation of 3 takes plain 49, then unmakes the top free stripe (5, 6)
    assert ids(pool.get_new_blocks(3)) == [49, 5, 6]
    assert pool.free_queue.block_ids()[0] == 7
    pool.check_invariants({49: 1, 5: 1, 6: 1})


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
