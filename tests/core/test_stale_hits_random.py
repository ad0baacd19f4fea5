"""Random interleavings of prefix look-ups, admissions with hits found any number of
steps earlier (possibly for another request), decode steps, frees and cache resets,
in both layouts, on a small pool that evicts all the time: driven by Hypothesis and
by a seeded loop weighted towards old hits.

A KV content oracle stands in for the model: every block a request computes is
recorded as holding that request's token prefix (per group and block id: each group
has its own layer tensors). Then:

* a hit that raises StaleHitError changed nothing (whole-state snapshot) and the
  manager's invariants hold;
* a hit whose blocks still hold the request's hashes is accepted (no false alarm);
* after any accepted call, every full block in every live request's table holds
  that request's prefix: no block serves two different prefixes.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.specs import cdiv
from hybridkv.errors import StaleHitError

from tests.support.kv_specs import chunked, full, manager_snapshot, sliding
from tests.support.tiers import examples, slow_except

BS = 2
SPECS = (full(BS), sliding(3, BS), chunked(6, BS), chunked(6, BS), sliding(5, BS))
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 20, 21, 22], [30, 31, 32, 33, 34]]
MAX_LEN = 40


class Harness:
    """A manager, its requests and the content oracle; each method is one scheduler action."""

    def __init__(self, stripe: bool, num_blocks: int = 46):
        cfg = KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in SPECS))
        self.kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=MAX_LEN, stripe_groups=stripe))
        self.num_blocks = num_blocks
        self.waiting: dict[str, object] = {}
        self.running: dict[str, object] = {}
        self.hits: list[tuple] = []  # (request it was found for, blocks, n, per-group ids then)
        self.content: dict[tuple[int, int], tuple | None] = {}  # (group, block id) -> token prefix
        self.next_id = 0
        self.outcomes: Counter = Counter()

    def add(self, prefix: int, cut: int, tail: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[rid] = self.kv.make_request(rid, PREFIXES[prefix][:cut] + tail)

    def look_up_all(self) -> None:
        for req in self.waiting.values():
            blocks, n = self.kv.get_computed_blocks(req)
            if n:
                self.hits.append((req, blocks, n, tuple(map(tuple, blocks.get_block_ids()))))
        del self.hits[:-6]

    def admit_with_old_hit(self, i: int, other: str | None, chunk: int) -> None:
        """Use hit i (found for its request; for ``other`` if given and waiting)."""
        found_for, blocks, n, ids = self.hits.pop(i)
        rid = other if other in self.waiting else found_for.request_id
        if rid not in self.waiting:
            return
        req = self.waiting[rid]
        if n >= req.num_tokens:
            return
        fine = self._holds_hashes(req, ids, n)
        before = manager_snapshot(self.kv, [req])
        try:
            ok = self._step(rid, req, min(chunk, req.num_tokens - n), n, blocks)
        except StaleHitError:
            assert not fine, "a hit whose blocks still hold the request's hashes was refused"
            assert manager_snapshot(self.kv, [req]) == before
            self.kv.check_invariants()
            self.outcomes["stale"] += 1
            return
        self.outcomes["accepted after eviction" if ok and blocks._epoch != self.kv.pool.cache_epoch else
                      "accepted" if ok else "no room"] += 1
        if not ok:
            assert manager_snapshot(self.kv, [req]) == before
            return
        for g, hit_ids in enumerate(ids):  # the adopted blocks hold this request's prefix
            for j, b in enumerate(hit_ids):
                if b:
                    assert self.content.get((g, b)) == tuple(req.all_token_ids[:(j + 1) * BS]), (g, j, b)
        self.running[rid] = self.waiting.pop(rid)

    def admit_fresh(self, rid: str, chunk: int) -> None:
        req = self.waiting[rid]
        blocks, n = self.kv.get_computed_blocks(req)
        if self._step(rid, req, min(chunk, req.num_tokens - n), n, blocks):
            self.running[rid] = self.waiting.pop(rid)

    def advance(self, rid: str, chunk: int) -> None:
        req = self.running[rid]
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens, MAX_LEN - 2 - req.num_computed_tokens)
        if num_new <= 0 or not self._step(rid, req, num_new):
            self.free(rid)

    def free(self, rid: str) -> None:
        req = self.running.pop(rid)
        self.kv.free(req)
        req.num_computed_tokens = 0  # preempted: it may come back
        self.waiting[rid] = req

    def reset(self) -> None:
        assert self.kv.reset_prefix_cache() == (not self.running)

    def check(self) -> None:
        self.kv.check_invariants()
        for rid, req in self.running.items():
            for g, table in enumerate(self.kv.get_block_ids(rid)):
                for i in range(req.num_computed_tokens // BS):
                    if table[i]:
                        assert self.content.get((g, table[i])) == tuple(req.all_token_ids[:(i + 1) * BS]), (rid, g, i)

    def finish_all(self) -> None:
        for rid in list(self.running):
            self.free(rid)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.num_blocks - 1

    # ------------------------------------------------------------------ helpers
    def _write(self, rid, req, start, end):
        """The model computes tokens [start, end) of ``req`` into its blocks."""
        for g, table in enumerate(self.kv.get_block_ids(rid)):
            for i in range(start // BS, cdiv(end, BS)):
                assert table[i] != 0, (g, i, table)
                full_block = (i + 1) * BS <= end
                self.content[(g, table[i])] = tuple(req.all_token_ids[:(i + 1) * BS]) if full_block else None

    def _holds_hashes(self, req, ids, n):
        """Every lead block of the hit still cached, for its group, under req's hash at its position."""
        blocks = self.kv.pool.blocks
        for m in self.kv.coordinator.managers:
            g = m.group_ids[0]
            for i, b in enumerate(ids[g][:n // BS]):
                if b and (blocks[b].block_hash != req.block_hashes[i] or blocks[b].group_id != g):
                    return False
        return True

    def _step(self, rid, req, num_new, n=0, hit=None):
        """allocate_slots as a scheduler calls it; on success the tokens are computed."""
        start = req.num_computed_tokens + n
        if self.kv.allocate_slots(req, num_new, n, hit) is None:
            return False
        self._write(rid, req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_token_ids(50 + req.num_tokens % 3)
        return True


# ---------------------------------------------------------------------- Hypothesis
class StaleHitMachine(RuleBasedStateMachine):
    STRIPE = True

    def __init__(self):
        super().__init__()
        self.h = Harness(self.STRIPE)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 11), tail=st.lists(st.integers(40, 42), max_size=4))
    def add_request(self, prefix, cut, tail):
        self.h.add(prefix, cut, tail)

    @precondition(lambda self: self.h.waiting)
    @rule()
    def look_up_all_waiting(self):
        self.h.look_up_all()

    @precondition(lambda self: self.h.hits and self.h.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def admit_with_old_hit(self, data, chunk):
        i = data.draw(st.integers(0, len(self.h.hits) - 1))
        other = data.draw(st.sampled_from(sorted(self.h.waiting))) if data.draw(st.integers(0, 4)) == 0 else None
        self.h.admit_with_old_hit(i, other, chunk)

    @precondition(lambda self: self.h.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def admit_fresh(self, data, chunk):
        self.h.admit_fresh(data.draw(st.sampled_from(sorted(self.h.waiting))), chunk)

    @precondition(lambda self: self.h.running)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def advance(self, data, chunk):
        self.h.advance(data.draw(st.sampled_from(sorted(self.h.running))), chunk)

    @precondition(lambda self: self.h.running)
    @rule(data=st.data())
    def finish(self, data):
        self.h.free(data.draw(st.sampled_from(sorted(self.h.running))))

    @rule()
    def reset_cache_when_idle(self):
        self.h.reset()

    @invariant()
    def consistent(self):
        self.h.check()

    def teardown(self):
        self.h.finish_all()


class StaleHitGroupsMachine(StaleHitMachine):
    STRIPE = False


_SETTINGS = settings(max_examples=examples(40), stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestStaleHitsStripes = StaleHitMachine.TestCase
TestStaleHitsStripes.settings = _SETTINGS
TestStaleHitsGroups = StaleHitGroupsMachine.TestCase
TestStaleHitsGroups.settings = _SETTINGS


# --------------------------------------------------------------------- seeded loop
@pytest.mark.parametrize("stripe", slow_except([True, False], 0))
def test_seeded_old_hits(stripe):
    """Weighted towards old hits: each kind of outcome must occur, so the test can fail."""
    total: Counter = Counter()
    for seed in range(12):
        rng = random.Random(seed)
        h = Harness(stripe)
        for _ in range(150):
            r = rng.random()
            if r < 0.2 or not h.waiting:
                h.add(rng.randrange(len(PREFIXES)), rng.randint(1, 11), [rng.randint(40, 42) for _ in range(rng.randint(0, 4))])
            elif r < 0.4:
                h.look_up_all()
            elif r < 0.6 and h.hits:
                other = rng.choice(sorted(h.waiting)) if rng.random() < 0.2 else None
                h.admit_with_old_hit(rng.randrange(len(h.hits)), other, rng.randint(1, 8))
            elif r < 0.75:
                h.admit_fresh(rng.choice(sorted(h.waiting)), rng.randint(1, 8))
            elif r < 0.92 and h.running:
                h.advance(rng.choice(sorted(h.running)), rng.randint(1, 6))
            elif h.running:
                h.free(rng.choice(sorted(h.running)))
            elif r > 0.99:
                h.reset()
            h.check()
        h.finish_all()
        total += h.outcomes
    assert {"stale", "accepted", "accepted after eviction", "no room"} <= set(total), total
