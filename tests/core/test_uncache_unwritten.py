"""``KVCacheManager.uncache_unwritten``: after a failed step, the blocks holding tokens the step
would have computed lose their content address (BlockRemoved events), nothing else does, the
request keeps its blocks, and a later request finds only the prefix written before."""

from __future__ import annotations

import random

import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.events import BlockRemoved
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.errors import InvalidArgumentError, UnknownRequestError
from tests.support.kv_specs import chunked, full, sliding, state

BS = 4


def manager(*specs, num_blocks=256):
    cfg = KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs))
    return KVCacheManager(cfg, CacheManagerConfig(max_model_len=400, enable_kv_events=True))


def cached_positions(kv: KVCacheManager, rid: str) -> list[list[int]]:
    return [[i for i, b in enumerate(m.state(rid).blocks) if b.block_hash is not None] for m in kv.coordinator.managers]


def test_worked_example_of_the_docstring():
    kv = manager(full(BS))
    req = kv.make_request("a", list(range(20)))
    assert kv.allocate_slots(req, 6) is not None  # step 1: tokens 0-5 (block 0 cached)
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 8) is not None  # step 2, tokens 6-13: caches blocks 1-2
    assert cached_positions(kv, "a") == [[0, 1, 2]]
    kv.take_events()
    assert kv.uncache_unwritten(req, 6) == 2
    assert cached_positions(kv, "a") == [[0]]
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(e.block_id for e in removed) == sorted(kv.get_block_ids("a")[0][1:3])
    kv.check_invariants()
    req.num_computed_tokens = 14  # as the scheduler left it; the engine then frees or recomputes it
    kv.free(req)
    kv.check_invariants()
    other = kv.make_request("b", list(range(20)))
    assert kv.get_computed_blocks(other)[1] == 4  # only block 0 was written


SPEC_MIXES = [
    (full(BS),),
    (full(BS), sliding(6, BS)),
    (full(BS), chunked(8, BS), chunked(8, BS), chunked(8, BS)),
    (sliding(5, BS), sliding(5, BS)),
    (full(BS), state(BS)),
]


@pytest.mark.parametrize("mix", range(len(SPEC_MIXES)))
@pytest.mark.parametrize("seed", range(12))
def test_random_failed_steps_uncache_exactly_the_unwritten_blocks(mix, seed):
    rng = random.Random(seed * 31 + mix)
    kv = manager(*SPEC_MIXES[mix])
    shared = [rng.randrange(50) for _ in range(rng.randint(0, 12))]
    reqs = []
    for i in range(rng.randint(1, 4)):
        tokens = shared + [rng.randrange(50) for _ in range(rng.randint(2, 30))]
        req = kv.make_request(f"r{i}", tokens)
        kv.new_step_starts()  # a state checkpoint is found from the step after its own on
        blocks, hit = kv.get_computed_blocks(req)
        n = rng.randint(1, req.num_tokens - hit)
        assert kv.allocate_slots(req, n, hit, blocks) is not None
        req.num_computed_tokens = hit + n
        while req.num_computed_tokens < req.num_tokens and rng.random() < 0.6:
            n = rng.randint(1, req.num_tokens - req.num_computed_tokens)
            assert kv.allocate_slots(req, n) is not None
            req.num_computed_tokens += n
        reqs.append(req)
    kv.check_invariants()
    kv.take_events()
    victim = rng.choice(reqs)
    written = rng.randint(0, victim.num_computed_tokens)
    first = written // BS
    before = {m: [b.block_hash for b in m.state(victim.request_id).blocks] for m in kv.coordinator.managers}
    others = {r.request_id: cached_positions(kv, r.request_id) for r in reqs if r is not victim}
    n = kv.uncache_unwritten(victim, written)
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == n
    for m in kv.coordinator.managers:
        now = [b.block_hash for b in m.state(victim.request_id).blocks]
        assert now[:first] == before[m][:first]  # written before: untouched
        assert all(h is None for h in now[first:])
        assert m.state(victim.request_id).num_cached <= first
    for rid, positions in others.items():  # another request's blocks lose an address only if shared
        for m, was, now in zip(kv.coordinator.managers, positions, cached_positions(kv, rid)):
            assert set(now) <= set(was)
    kv.check_invariants()
    for r in reqs:
        kv.free(r)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.usable_blocks


def test_misuse_changes_nothing():
    kv = manager(full(BS))
    req = kv.make_request("a", list(range(10)))
    with pytest.raises(UnknownRequestError):
        kv.uncache_unwritten(req, 0)
    assert kv.allocate_slots(req, 8) is not None
    for bad in (-1, 1.5, True, None):
        with pytest.raises(InvalidArgumentError):
            kv.uncache_unwritten(req, bad)
    assert cached_positions(kv, "a") == [[0, 1]]
    with pytest.raises(InvalidArgumentError):
        kv.pool.uncache([kv.pool.null_block])
    kv.check_invariants()
