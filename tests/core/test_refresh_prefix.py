"""``BlockPool.refresh`` and ``KVCacheManager.refresh_prefix_hit``: a queued request's cached
prefix moves to the LRU's tail, nothing else changes (references, free count, hashes)."""

from __future__ import annotations

import random

import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.scheduler.config import SchedulerConfig
from hybridkv.scheduler.interface import SamplingParams
from hybridkv.scheduler.scheduler import Scheduler

from tests.support.kv_specs import chunked, full, pool_snapshot, sliding


def manager(*specs, num_blocks=64, **kw):
    cfg = KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs))
    return KVCacheManager(cfg, CacheManagerConfig(max_model_len=1000, **kw))


def run(kv, rid, tokens):
    """Prefill ``tokens`` as one request, then free it: its blocks stay cached, free."""
    req = kv.make_request(rid, tokens)
    blocks, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, n, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    kv.free(req)
    kv.check_invariants()
    return req


def test_refresh_moves_free_cached_blocks_to_the_tail_in_order():
    kv = manager(full(4), num_blocks=16)
    run(kv, "a", list(range(9)))  # blocks of 2 full blocks cached (8 tokens), freed tail-first
    run(kv, "b", list(range(100, 109)))
    lru = list(kv.pool.free_queue.lru)
    assert len(lru) == 4
    a_blocks = [b for b in kv.pool.free_queue.lru.values() if b.block_id in lru[:2]]
    moved = kv.pool.refresh(a_blocks[::-1])
    assert moved == 2
    assert list(kv.pool.free_queue.lru) == lru[2:] + [b.block_id for b in a_blocks[::-1]]


def test_refresh_leaves_held_null_and_foreign_blocks_alone():
    kv = manager(full(4), sliding(5), num_blocks=32)
    req = kv.make_request("a", list(range(13)))
    assert kv.allocate_slots(req, 13) is not None
    req.num_computed_tokens = 13
    before = pool_snapshot(kv.pool)
    held = [b for g in kv.get_blocks("a").blocks for b in g]
    other = manager(full(4), num_blocks=32)
    run(other, "x", list(range(9)))
    assert kv.pool.refresh(held + [kv.pool.null_block] + list(other.pool.free_queue.lru.values())) == 0
    assert pool_snapshot(kv.pool) == before


@pytest.mark.parametrize("seed", range(12))
def test_refresh_prefix_hit_changes_only_the_lru_order_and_protects_the_hit(seed):
    rng = random.Random(seed)
    specs = rng.choice([(full(4),), (full(4), sliding(6)), (full(4), chunked(8)), (full(4), sliding(5), chunked(8))])
    kv = manager(*specs, num_blocks=rng.randrange(24, 48))
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(5, 26))] for _ in range(6)]
    for i in range(20):
        base = rng.choice(prompts)
        run(kv, f"r{i}", base[: rng.randrange(2, len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(3))])
        probe = kv.make_request(f"p{i}", rng.choice(prompts))
        before = pool_snapshot(kv.pool)
        stats = (kv.stats.requests, kv.stats.queries, kv.stats.hits)
        hit_before = kv.peek_prefix_hit(probe.all_token_ids)
        assert kv.refresh_prefix_hit(probe) == hit_before
        after = pool_snapshot(kv.pool)
        # blocks, hash maps, free count, epoch unchanged; the LRU holds the same entries
        assert after[0] == before[0] and after[2:] == before[2:]
        assert sorted(after[1][0]) == sorted(before[1][0]) and after[1][1] == before[1][1]
        assert (kv.stats.requests, kv.stats.queries, kv.stats.hits) == stats
        assert kv.peek_prefix_hit(probe.all_token_ids) == hit_before
        kv.check_invariants()
        if hit_before:  # the hit's free blocks are now the LRU's last entries
            hit, _ = kv.coordinator.find_hit(probe.block_hashes, probe.num_tokens - 1)
            free_hit = {b.block_id for leads in hit.values() for b in leads if b.ref_cnt == 0 and not b.is_null}
            tail = list(kv.pool.free_queue.lru)[len(kv.pool.free_queue.lru) - len(free_hit):]
            assert set(tail) == free_hit


@pytest.mark.parametrize("policy, want", [("refresh", 8), ("pin", 8), ("none", 0)])
def test_scheduler_keeps_a_queued_requests_prefix_through_the_queue_ahead(policy, want):
    """Pool of 14 blocks (block 4): a cached 8-token prefix at the LRU head, then a queued
    request wanting it behind a running one that needs all other free blocks and one more.
    With refresh (or a pin) the running request evicts the other cached blocks; without, the prefix."""

    def scenario(policy: str) -> int:
        kv = manager(full(4), num_blocks=14)
        sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64,
                                              queued_prefix=policy))
        run(kv, "warm", list(range(9)))          # 2 cached blocks (prefix 0..7) at the LRU head
        run(kv, "filler", list(range(100, 141)))  # 10 cached blocks after them
        two = SamplingParams(max_tokens=2)
        sched.add_request("big", list(range(200, 241)), two)  # 41 + 2 tokens: 11 blocks
        sched.add_request("want", list(range(9)), two)        # queued behind it, hit 8 if kept
        assert kv.pool.num_free_blocks == (11 if policy == "pin" else 13)  # a pin holds the 2 blocks
        assert sched.sequences["want"].arrival_hit_tokens == (0 if policy == "none" else 8)  # the hit when queued
        seen = {}
        for _ in range(60):
            out = sched.schedule()
            for sr in out.scheduled:
                seq = sched.sequences[sr.request_id]
                seen.setdefault(sr.request_id, seq.num_cached_tokens)
                assert seq.last_hit_tokens == seq.num_cached_tokens  # admitted once
            sched.update_from_output(out, {sr.request_id: 1 for sr in out.scheduled if sr.sample})
            sched.check_invariants()
            if not sched.has_unfinished_requests():
                break
        return seen["want"]

    assert scenario(policy) == want


@pytest.mark.parametrize("groups", [(full(4),), (full(4), sliding(6, 4))])
def test_refresh_keeps_a_waiting_hit_behind_blocks_freed_after_it_arrived(groups):
    """"refresh" marks a waiting request's hit as used at every step, not only on arrival:
    blocks a finishing request frees while it waits go to the LRU's tail after its hit,
    and the next step moves its hit behind them again (so they are evicted first)."""

    def tail_after_step_2(refresh_each_step: bool) -> bool:
        kv = manager(*groups, num_blocks=64)
        sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=128,
                                              queued_prefix="refresh"))
        if not refresh_each_step:
            sched._refresh_waiting = lambda: None  # arrival only
        run(kv, "warm", list(range(9)))  # the cached prefix "want" will hit
        sched.add_request("a", list(range(100, 120)), SamplingParams(max_tokens=2))  # runs, finishes at step 1
        sched.add_request("b", list(range(200, 212)), SamplingParams(max_tokens=30))  # runs from step 2 on
        sched.add_request("want", list(range(9)), SamplingParams(max_tokens=2))  # waits behind both
        for _ in range(3):
            out = sched.schedule()
            sched.update_from_output(out, {sr.request_id: 1 for sr in out.scheduled if sr.sample})
            sched.check_invariants()
        assert [s.request_id for s in sched.running] == ["b"] and sched.waiting[0].request_id == "want"
        probe = kv.make_request("probe", list(range(9)))
        hit, n = kv.coordinator.find_hit(probe.block_hashes, probe.num_tokens - 1)
        assert n == 8
        free_hit = {b.block_id for leads in hit.values() for b in leads if not b.is_null and b.ref_cnt == 0}
        lru = list(kv.pool.free_queue.lru)
        return bool(free_hit) and set(lru[len(lru) - len(free_hit):]) == free_hit

    assert tail_after_step_2(refresh_each_step=True)
    assert not tail_after_step_2(refresh_each_step=False)  # "a"'s blocks, freed at step 1, are behind it


# ----------------------------------------------------------------------------- pins
def test_a_pinned_prefix_survives_allocations_that_would_evict_it():
    kv = manager(full(4), sliding(5), num_blocks=24)
    run(kv, "warm", list(range(13)))  # 3 blocks in each group cached, free
    req = kv.make_request("want", list(range(13)) + [99])
    free = kv.num_free_blocks
    assert kv.pins.pin(req) == 12 and kv.pins.pin(req) == 0  # pinned once
    held = free - kv.num_free_blocks
    assert held >= 3  # the full group's 3 blocks and the sliding group's window
    kv.check_invariants()
    left = kv.num_free_blocks
    hog = kv.make_request("hog", list(range(500, 500 + 4 * (left // 2))))
    assert kv.allocate_slots(hog, hog.num_tokens) is not None  # takes every other free block (2 groups)
    assert kv.num_free_blocks == left % 2
    kv.check_invariants()
    assert kv.peek_prefix_hit(req.all_token_ids) == 12  # still cached
    assert kv.pins.unpin("want") and not kv.pins.unpin("want")
    assert kv.num_free_blocks == held + left % 2
    kv.free(hog)
    blocks, hit = kv.get_computed_blocks(req)
    assert hit == 12 and kv.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    kv.check_invariants()


@pytest.mark.parametrize("seed", range(10))
def test_pins_change_only_which_blocks_are_free(seed):
    """Random pins and unpins over random cache contents: tables, hashes and hits are
    unchanged, the free count drops by the pinned blocks that were free, invariants hold."""
    rng = random.Random(seed)
    specs = rng.choice([(full(4),), (full(4), sliding(6)), (full(4), chunked(8), chunked(8)), (sliding(5), full(4))])
    kv = manager(*specs, num_blocks=rng.randrange(30, 60))
    prompts = [[rng.randrange(40) for _ in range(rng.randrange(6, 26))] for _ in range(5)]
    for i in range(8):
        run(kv, f"r{i}", rng.choice(prompts)[: rng.randrange(2, 26)])
    probes = [kv.make_request(f"p{i}", rng.choice(prompts) + [rng.randrange(40)]) for i in range(6)]
    total = kv.num_free_blocks
    for _ in range(30):
        p = rng.choice(probes)
        before = {q.request_id: kv.peek_prefix_hit(q.all_token_ids) for q in probes}
        if rng.random() < 0.6:
            kv.pins.pin(p)
        elif rng.random() < 0.5:
            kv.pins.unpin(p.request_id)
        else:
            kv.pins.unpin_last(keep=p.request_id)
        kv.check_invariants()
        assert {q.request_id: kv.peek_prefix_hit(q.all_token_ids) for q in probes} == before
        pinned = set(kv.pins.ref_counts())
        assert kv.num_free_blocks == total - len(pinned)
    kv.pins.clear()
    assert kv.num_free_blocks == total and len(kv.pins) == 0
    kv.check_invariants()


def test_a_running_request_takes_a_pinned_block_before_anyone_is_preempted():
    """A running request that needs more blocks than are free gets them from the latest pin
    (released first), not by preempting itself; the queued request then just misses."""
    kv = manager(full(4), num_blocks=12)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64,
                                          queued_prefix="pin"))
    run(kv, "warm", list(range(9)))                                      # 2 cached blocks
    sched.add_request("big", list(range(200, 233)), SamplingParams(max_tokens=8))  # 33 + 8 tokens: 9, then 11 blocks
    sched.add_request("want", list(range(9)), SamplingParams(max_tokens=2))         # pins the 2 blocks
    assert len(kv.pins) == 1 and kv.num_free_blocks == 9
    preempted = 0
    released_while_waiting = False
    for _ in range(60):
        out = sched.schedule()
        preempted += len(out.preempted_request_ids)
        released_while_waiting |= not kv.pins and any(s.request_id == "want" for s in sched.waiting)
        sched.update_from_output(out, {sr.request_id: 1 for sr in out.scheduled if sr.sample})
        sched.check_invariants()
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests() and preempted == 0 and len(kv.pins) == 0 and released_while_waiting
    assert kv.num_free_blocks == 11


def test_an_aborted_queued_request_releases_its_pin():
    kv = manager(full(4), num_blocks=16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                                          queued_prefix="pin"))
    run(kv, "warm", list(range(9)))
    sched.add_request("want", list(range(9)), SamplingParams(max_tokens=2))
    assert len(kv.pins) == 1 and kv.num_free_blocks == 13
    sched.abort_request("want")
    assert len(kv.pins) == 0 and kv.num_free_blocks == 15
    sched.check_invariants()
