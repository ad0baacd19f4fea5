import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.events import BlockRemoved, BlockStored
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    PromptTooLongError,
    RequestError,
    RequestFreedError,
    UnknownRequestError,
)

from tests.support.kv_specs import chunked, full, sliding


def manager(*specs, num_blocks=64, max_model_len=1000, **kw):
    cfg = KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs))
    return KVCacheManager(cfg, CacheManagerConfig(max_model_len=max_model_len, **kw))


def step(kv, req, n=1, sampled=0):
    """One scheduler step: allocate n new tokens, mark them computed, append a token."""
    new = kv.allocate_slots(req, n)
    assert new is not None
    req.num_computed_tokens += n
    if sampled is not None:
        req.append_token_ids(sampled)
    kv.check_invariants()
    return new.get_block_ids()


def prefill(kv, req):
    blocks, n = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - n, n, blocks)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    req.append_token_ids(7)
    kv.check_invariants()
    return n, new.get_block_ids()


def test_scout_shaped_decode_replaces_dead_chunk_blocks_by_null():
    # 1 full + 3 chunked (C 8), block 4, 10-token prompt
    kv = manager(full(4), chunked(8), chunked(8), chunked(8))
    req = kv.make_request("a", list(range(10)))
    n, new = prefill(kv, req)
    # the fresh pool is bound into stripes (1, 2, 3), (4, 5, 6), ...: the full group
    # unmakes one, the three chunked groups take three whole (one per position)
    assert n == 0 and new == ([1, 2, 3], [4, 7, 10], [5, 8, 11], [6, 9, 12])
    # computing token 10: its chunk starts at 8 -> blocks 0, 1 of every chunked group die
    assert step(kv, req) == ([], [], [], [])
    assert kv.get_block_ids("a") == ([1, 2, 3], [0, 0, 10], [0, 0, 11], [0, 0, 12])
    assert step(kv, req) == ([], [], [], [])  # token 11
    # token 12 needs a 4th block: the full group unmakes stripe (13, 14, 15) and keeps
    # 14, 15 as free plain blocks; the chunked groups take stripe (16, 17, 18)
    assert step(kv, req) == ([13], [16], [17], [18])
    for _ in range(4):  # tokens 13..16; at 16 computed the next token starts chunk 2
        step(kv, req)
    assert kv.get_block_ids("a") == ([1, 2, 3, 13, 14], [0, 0, 0, 0, 19], [0, 0, 0, 0, 20], [0, 0, 0, 0, 21])
    assert kv.usage == (5 + 3) / 63
    kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == 63


def test_prefix_hit_shares_blocks_across_requests():
    kv = manager(full(4), chunked(8))
    a = kv.make_request("a", list(range(18)))
    prefill(kv, a)
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    b = kv.make_request("b", list(range(16)) + [99, 98, 97])
    blocks, n = kv.get_computed_blocks(b)
    # max_length 18 -> full hits blocks 0-3 (16 tokens); chunked(16): token 16 starts a
    # chunk, so 16 tokens count as computed with null blocks
    assert n == 16
    assert blocks.get_block_ids() == ([1, 2, 3, 4], [0, 0, 0, 0])
    new = kv.allocate_slots(b, 3, n, blocks)
    assert new.get_block_ids() == ([11], [12])
    assert kv.get_block_ids("b") == ([1, 2, 3, 4, 11], [0, 0, 0, 0, 12])
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 4, 5)] == [2, 2, 1]
    kv.check_invariants()
    assert kv.stats.queries == 18 + 19 and kv.stats.hits == 16
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    # after both finish the prefix is still cached: a third request hits it from the free queue
    c = kv.make_request("c", list(range(18)))
    blocks, n = kv.get_computed_blocks(c)
    assert n == 16 and blocks.get_block_ids() == ([1, 2, 3, 4], [0, 0, 0, 0])
    assert kv.allocate_slots(c, 2, n, blocks) is not None
    kv.check_invariants()


def test_sliding_window_hit_and_skip():
    kv = manager(full(4), sliding(6))
    a = kv.make_request("a", list(range(20)))
    prefill(kv, a)
    b = kv.make_request("b", list(range(20)))
    blocks, n = kv.get_computed_blocks(b)
    # max 19 -> full 16; sliding W 6 needs cdiv(5, 4) = 2 blocks before 16: blocks 2, 3
    assert n == 16 and blocks.get_block_ids() == ([1, 2, 3, 4], [0, 0, 8, 9])
    kv.allocate_slots(b, 4, n, blocks)
    assert kv.get_block_ids("b") == ([1, 2, 3, 4, 11], [0, 0, 8, 9, 12])
    kv.check_invariants()


def test_allocation_failure_returns_none_and_changes_nothing():
    kv = manager(full(4), chunked(8), num_blocks=8)  # 7 usable
    a = kv.make_request("a", list(range(12)))
    prefill(kv, a)  # 3 + 3 blocks
    before = (kv.get_block_ids("a"), kv.num_free_blocks)
    b = kv.make_request("b", list(range(100, 108)))
    blocks, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 8, n, blocks) is None
    assert (kv.get_block_ids("a"), kv.num_free_blocks) == before
    assert not kv.has_request("b")
    kv.check_invariants()


def test_preempted_request_recomputes_with_its_own_cached_prefix():
    kv = manager(full(4), chunked(8))
    a = kv.make_request("a", list(range(13)))
    prefill(kv, a)
    kv.free(a)  # preempted
    a.num_computed_tokens = 0
    blocks, n = kv.get_computed_blocks(a)
    # 14 tokens, max 13 -> full 12; chunked(12): chunk starts 8, block 2 cached -> 12
    assert n == 12 and blocks.get_block_ids() == ([1, 2, 3], [0, 0, 7])
    # the uncached partial blocks 4 and 8 were freed to the head of the queue
    assert kv.pool.free_queue.block_ids()[:2] == [8, 4]
    assert kv.allocate_slots(a, 2, n, blocks).get_block_ids() == ([8], [4])
    kv.check_invariants()


def test_kv_events_name_group_and_spec_kind():
    kv = manager(full(4), chunked(8), enable_kv_events=True)
    a = kv.make_request("a", list(range(9)))
    prefill(kv, a)
    events = kv.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.group_id, e.spec_kind, e.block_ids) for e in stored] == [
        (0, "full_attention", (1, 2)),
        (1, "chunked_local_attention", (4, 5)),
    ]
    assert stored[0].block_hashes == tuple(a.block_hashes[:2]) and stored[0].parent_hash is None
    assert [(e.token_ids, e.attention_span) for e in stored] == [(tuple(range(8)), None), (tuple(range(8)), 8)]
    assert kv.take_events() == []


def test_eviction_event_when_cached_block_is_reused():
    kv = manager(full(4), num_blocks=4, enable_kv_events=True)
    a = kv.make_request("a", list(range(8)))
    prefill(kv, a)
    kv.free(a)
    kv.take_events()
    b = kv.make_request("b", list(range(50, 62)))
    assert kv.allocate_slots(b, 12) is not None
    assert [type(e) for e in kv.take_events()].count(BlockRemoved) == 2


def test_eagle_config():
    kv = manager(full(4), use_eagle=True)
    a = kv.make_request("a", list(range(13)))
    prefill(kv, a)
    b = kv.make_request("b", list(range(13)))
    assert kv.get_computed_blocks(b)[1] == 8  # 12 would hit; EAGLE drops a block


def test_caching_off():
    kv = manager(full(4), enable_caching=False)
    a = kv.make_request("a", list(range(8)))
    prefill(kv, a)
    b = kv.make_request("b", list(range(8)))
    assert kv.get_computed_blocks(b)[1] == 0
    assert kv.pool.num_cached_blocks == 0


def test_reset_prefix_cache():
    kv = manager(full(4))
    a = kv.make_request("a", list(range(8)))
    prefill(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(kv.make_request("b", list(range(9))))[1] == 0


def test_misuse_is_typed_and_leaves_state_unchanged():
    kv = manager(full(4), chunked(8), max_model_len=32)
    a = kv.make_request("a", list(range(8)))
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(a, -1)
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(a, 9)  # more tokens than the request has
    with pytest.raises(UnknownRequestError):
        kv.free(a)
    with pytest.raises(UnknownRequestError):
        kv.get_block_ids("a")
    prefill(kv, a)
    twin = kv.make_request("a", list(range(8)))
    with pytest.raises(RequestError):
        kv.allocate_slots(twin, 1)
    hit_blocks, _ = kv.get_computed_blocks(kv.make_request("x", list(range(9))))
    with pytest.raises(RequestError):
        kv.allocate_slots(a, 0, 4, hit_blocks)  # a prefix hit for a running request
    long = kv.make_request("long", list(range(40)))
    with pytest.raises(PromptTooLongError):
        kv.allocate_slots(long, 40)
    b = kv.make_request("b", list(range(8)))
    blocks, n = kv.get_computed_blocks(b)
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(b, 1, n + 4, blocks)
    snapshot = (kv.get_block_ids("a"), kv.num_free_blocks)
    kv.free(a)
    with pytest.raises(RequestFreedError):
        kv.free(a)
    assert kv.num_free_blocks == 63
    assert snapshot[1] < 63
    kv.check_invariants()


def test_config_errors():
    with pytest.raises(InvalidConfigError):
        KVCacheConfig(1, (KVCacheGroup(full(4)),))
    with pytest.raises(InvalidConfigError):
        KVCacheConfig(10, (KVCacheGroup(full(4)), KVCacheGroup(full(8))))
    with pytest.raises(InvalidConfigError):
        CacheManagerConfig(max_model_len=0)
    with pytest.raises(InvalidConfigError):
        manager(full(4), hash_algo="md5")
