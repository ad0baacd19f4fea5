"""Chunked local attention: token i attends to [floor(i/C)*C, i]."""

import pytest

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.managers import ChunkedLocalAttentionManager
from hybridkv.core.request import BlockHasher, Request
from hybridkv.errors import InvalidArgumentError

from tests.support.kv_specs import chunked, fake_hashes, ids, mark_cached


def make(chunk, bs, groups=(0,), num_blocks=200):
    pool = BlockPool(num_blocks, num_groups=len(groups))
    return pool, ChunkedLocalAttentionManager(chunked(chunk, bs), groups, pool)


def hit_len(cached, max_length, chunk=2, bs=1):
    pool, m = make(chunk, bs)
    hashes = fake_hashes(len(cached))
    mark_cached(pool, hashes, cached)
    blocks, n = m.find_longest_cache_hit(hashes, max_length)
    assert len(blocks[0]) * bs == n
    return blocks[0], n


@pytest.mark.parametrize(
    "cached, expected",
    [
        # block_size 1, C 2, a 6-token prompt -> max_length 5
        ([0, 0, 0, 0, 0, 0], 4),  # [miss miss][miss miss][miss miss]
        ([0, 0, 1, 0, 0, 0], 4),  # [miss miss][hit miss][miss miss]: block 2 is never looked at
        ([0, 0, 0, 0, 1, 0], 5),  # [miss miss][miss miss][hit miss]
        ([1, 1, 1, 1, 1, 1], 5),
        ([1, 1, 1, 1, 0, 1], 4),
    ],
)
def test_hit_of_a_6_token_prompt_block1_chunk2(cached, expected):
    blocks, n = hit_len([bool(c) for c in cached], 5)
    assert n == expected
    assert ids(blocks[:4]) == [0, 0, 0, 0]  # chunks before token 5's chunk are null


def test_hit_blocks_are_the_cached_ones():
    blocks, n = hit_len([False] * 4 + [True, True, False], 6)
    # max_length 6 -> the next token (6) starts chunk [6, 8): six null blocks, no lookup
    assert n == 6 and ids(blocks) == [0] * 6
    blocks, n = hit_len([False] * 4 + [True, True, False], 5)
    assert n == 5 and ids(blocks) == [0, 0, 0, 0, 14]


def test_whole_chunks_before_the_next_token_need_no_lookup():
    # block 16, C 64, max_length 128: the next token (128) starts a new chunk, so all
    # 128 tokens count as computed with null blocks and nothing is looked up.
    blocks, n = hit_len([False] * 8, 128, chunk=64, bs=16)
    assert n == 128 and ids(blocks) == [0] * 8
    # max_length 127: token 127's chunk starts at 64 -> blocks 4.. must hit
    blocks, n = hit_len([False] * 8, 127, chunk=64, bs=16)
    assert n == 64 and ids(blocks) == [0] * 4
    blocks, n = hit_len([False] * 4 + [True] * 3 + [False], 127, chunk=64, bs=16)
    assert n == 112 and ids(blocks) == [0, 0, 0, 0, 14, 15, 16]


def test_chunk_not_multiple_of_block_keeps_the_straddling_block():
    # block 8, C 20: chunk starts 20, 40 ...; block 2 holds tokens 16-23 (straddles 20)
    # block 2 missed: a hit of 16 would need tokens 0-15 (token 16 is in chunk [0, 20)),
    # so the search restarts at 16 with chunk start 0 and finds nothing
    blocks, n = hit_len([False] * 5, 39, chunk=20, bs=8)
    assert n == 0 and ids(blocks) == []
    blocks, n = hit_len([True, True, False, False, False], 39, chunk=20, bs=8)
    assert n == 16 and ids(blocks) == [10, 11]
    # C 5, block 4, nothing cached, max_length 50: s = 50 -> 12 null blocks = 48 tokens
    # would leave token 48 (chunk [45, 50)) reading tokens 45-47: the answer is 40
    blocks, n = hit_len([False] * 13, 50, chunk=5, bs=4)
    assert n == 40 and ids(blocks) == [0] * 10
    blocks, n = hit_len([False, False, True, True, False], 39, chunk=20, bs=8)
    assert n == 32 and ids(blocks) == [0, 0, 12, 13]
    blocks, n = hit_len([False] * 5, 40, chunk=20, bs=8)
    assert n == 40 and ids(blocks) == [0] * 5


def test_groups_of_one_manager_hold_stripes_and_hit_together():
    # two chunked groups (C 4, block 1) share a manager: each position is one stripe
    pool, m = make(4, 1, groups=(0, 1), num_blocks=20)
    req = Request("r", list(range(7)), hasher=BlockHasher(1))
    m.save_new_computed_blocks("r", None, 0)
    assert m.get_num_blocks_to_allocate("r", 7, None, 0) == 14
    m.allocate_new_blocks("r", 7)
    # a fresh pool is bound into stripes (1, 2), (3, 4), ...: group j gets member j
    assert m.get_block_ids("r") == [[1, 3, 5, 7, 9, 11, 13], [2, 4, 6, 8, 10, 12, 14]]
    assert pool.blocks[5].stripe == (pool.blocks[5], pool.blocks[6])
    m.cache_blocks(req, 6)
    assert pool.lookup(req.block_hashes[5], 1) is pool.blocks[12]
    with pytest.raises(InvalidArgumentError):  # a follower group has no map of its own
        pool.cache_full_blocks([pool.blocks[15]], [b"x"], 0, 1, 1)
    m.remove_skipped_blocks("r", 6)  # next token 6: chunk starts at 4 -> positions 0-3 dead
    assert m.get_block_ids("r") == [[0, 0, 0, 0, 9, 11, 13], [0, 0, 0, 0, 10, 12, 14]]
    assert pool.num_free_blocks == 19 - 6  # four stripes of two back
    m.free("r")
    pool.check_invariants()
    assert pool.num_free_blocks == 19
    blocks, n = m.find_longest_cache_hit(req.block_hashes, 6)  # next token 6 -> start 4, 4 and 5 hit
    assert n == 6 and ids(blocks[0]) == [0, 0, 0, 0, 9, 11] and ids(blocks[1]) == [0, 0, 0, 0, 10, 12]


def alloc(m, rid, n_tokens):
    m.save_new_computed_blocks(rid, None, 0)
    m.allocate_new_blocks(rid, n_tokens)
    return m.get_block_ids(rid)[0]


def test_remove_skipped_blocks_frees_blocks_before_the_next_tokens_chunk():
    # block 128, C 1024: the next token after n computed is n; its chunk starts at
    # floor(n/1024)*1024. n = 1023 -> chunk 0, nothing to free. n = 1024 -> token 1024
    # starts chunk 1: blocks 0-7 are dead.
    pool, m = make(1024, 128, num_blocks=40)
    alloc(m, "r", 1100)
    before = list(m.get_block_ids("r")[0])
    assert before == list(range(1, 10))
    m.remove_skipped_blocks("r", 1023)
    assert m.get_block_ids("r")[0] == before
    m.remove_skipped_blocks("r", 1024)
    assert m.get_block_ids("r")[0] == [0] * 8 + [9]
    # uncached (never hashed) dead blocks go to the head of the free queue: reused first
    assert pool.free_queue.block_ids()[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    m.remove_skipped_blocks("r", 1025)
    assert m.get_block_ids("r")[0] == [0] * 8 + [9]
    pool.check_invariants({9: 1})


def test_remove_skipped_keeps_block_straddling_the_chunk_start():
    pool, m = make(20, 8, num_blocks=40)
    alloc(m, "r", 45)  # 6 blocks
    m.remove_skipped_blocks("r", 21)  # chunk start 20 -> blocks 0, 1 (tokens 0-15) dead; block 2 has 16-23
    assert m.get_block_ids("r")[0] == [0, 0, 3, 4, 5, 6]
    m.remove_skipped_blocks("r", 40)  # chunk start 40 -> blocks 0-4 (tokens 0-39) dead
    assert m.get_block_ids("r")[0] == [0, 0, 0, 0, 0, 6]


def test_block_counts_for_a_new_request_with_a_hit():
    # C 8, block 4, hit [null, null, b] for 12 computed tokens, 20 tokens wanted:
    # 2 skipped + 1 held -> 5 - 3 = 2 new blocks, plus b if it sits in the free queue
    pool, m = make(8, 4)
    hashes = fake_hashes(3)
    mark_cached(pool, hashes, [False, False, True])
    blocks, n = m.find_longest_cache_hit(hashes, 12)
    assert n == 12 and ids(blocks[0]) == [0, 0, 12]
    assert m.get_num_blocks_to_allocate("r", 20, blocks[0], 12) == 3
    m.save_new_computed_blocks("r", blocks[0], 12)
    assert pool.blocks[12].ref_cnt == 1
    assert m.get_num_blocks_to_allocate("r", 20, None, 12) == 2
    m.allocate_new_blocks("r", 20)
    assert m.get_block_ids("r")[0] == [0, 0, 12, 1, 2]
    ref = {}
    m.check_invariants(ref)
    assert ref == {12: 1, 1: 1, 2: 1}
