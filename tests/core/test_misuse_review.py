"""Misuse found by review after the first misuse table: each is refused with nothing changed."""

from __future__ import annotations

import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.errors import InvalidArgumentError, RequestError

from tests.support.kv_specs import chunked, full, sliding


def _snapshot(kv: KVCacheManager, rid: str):
    return kv.num_free_blocks, kv.get_block_ids(rid)


@pytest.mark.parametrize("stripes", [True, False])
@pytest.mark.parametrize("local", [sliding(3, 2), chunked(4, 2)])
def test_a_computed_count_moved_back_past_freed_blocks_is_refused(stripes, local):
    kv = KVCacheManager(
        KVCacheConfig(40, (KVCacheGroup(full(2)), KVCacheGroup(local), KVCacheGroup(local))),
        CacheManagerConfig(max_model_len=64, stripe_groups=stripes),
    )
    r = kv.make_request("a", list(range(1, 30)))
    for _ in range(21):  # decode one token at a time: the local groups free their old blocks
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    for bad in (2, 2.5, True, -1):
        r.num_computed_tokens = bad
        before = _snapshot(kv, "a")
        with pytest.raises(InvalidArgumentError):
            kv.allocate_slots(r, 1)
        assert _snapshot(kv, "a") == before
        kv.check_invariants()
    # a step back that reads nothing freed is allowed (speculative tokens rejected)
    r.num_computed_tokens = 20
    assert kv.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 21
    assert kv.allocate_slots(r, 1) is not None
    kv.check_invariants()


def test_free_refuses_another_managers_request_of_the_same_id():
    kv = KVCacheManager(KVCacheConfig(20, (KVCacheGroup(full()),)), CacheManagerConfig(max_model_len=64))
    other = KVCacheManager(KVCacheConfig(20, (KVCacheGroup(full()),)), CacheManagerConfig(max_model_len=64))
    r = kv.make_request("a", [1, 2, 3])
    assert kv.allocate_slots(r, 3) is not None
    free = kv.num_free_blocks
    with pytest.raises(RequestError):
        kv.free(other.make_request("a", [1, 2, 3]))
    assert kv.num_free_blocks == free and kv.has_request("a")
    kv.free("a")  # by id: allowed
    kv.check_invariants()


@pytest.mark.parametrize("prompt", [{1, 2}, frozenset([1, 2]), {1: 2}, "12", b"12"])
def test_unordered_or_text_prompts_are_refused(prompt):
    kv = KVCacheManager(KVCacheConfig(20, (KVCacheGroup(full()),)), CacheManagerConfig(max_model_len=64))
    with pytest.raises(InvalidArgumentError, match="ordered sequence of ints"):
        kv.make_request("a", prompt)


def test_admission_count_refuses_what_allocate_slots_refuses():
    kv = KVCacheManager(KVCacheConfig(20, (KVCacheGroup(full()),)), CacheManagerConfig(max_model_len=64))
    r = kv.make_request("a", list(range(1, 10)))
    with pytest.raises(InvalidArgumentError, match="must be KVCacheBlocks"):
        kv.num_blocks_to_admit(r, 9, "junk", 4)
    assert kv.num_blocks_to_admit(r, 9) == 3
    assert kv.allocate_slots(r, 9) is not None
    with pytest.raises(InvalidArgumentError, match="already holds blocks"):
        kv.num_blocks_to_admit(r, 9)
