"""Stripes change how blocks are held, not what a request gets: random sequences of
add / admit / advance / free on a striped manager and on one with a manager per group
(``stripe_groups=False``, vLLM's layout), in lock-step. With no eviction (the pool is
large enough) every hit length and its null positions, every allocation, every free and
cached count and every table's length and null positions must be the same. (Under
eviction the two may differ: a stripe is evicted whole; see benchmarks/RESULTS.md, S1.)"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager

from tests.support.kv_specs import chunked, full, sliding
from tests.support.tiers import examples

BS = 2
SPECS = (full(BS), chunked(6, BS), sliding(5, BS), chunked(6, BS), chunked(6, BS), sliding(5, BS))
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 20, 21, 22, 23], [30, 31, 32, 33]]


class StripesVsGroups(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        cfg = KVCacheConfig(2000, tuple(KVCacheGroup(s) for s in SPECS))
        self.a = KVCacheManager(cfg, CacheManagerConfig(max_model_len=64))
        self.b = KVCacheManager(cfg, CacheManagerConfig(max_model_len=64, stripe_groups=False))
        assert [m.width for m in self.a.coordinator.managers] == [1, 3, 2]
        assert len(self.b.coordinator.managers) == len(SPECS)
        self.waiting: dict[str, tuple] = {}
        self.running: dict[str, tuple] = {}
        self.next_id = 0

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 13), tail=st.lists(st.integers(40, 43), max_size=5))
    def add_request(self, prefix, cut, tail):
        prompt = PREFIXES[prefix][:cut] + tail
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[rid] = (self.a.make_request(rid, prompt), self.b.make_request(rid, prompt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        ra, rb = self.waiting.pop(rid)
        (ha, na), (hb, nb) = self.a.get_computed_blocks(ra), self.b.get_computed_blocks(rb)
        assert na == nb
        assert [[b.block_id == 0 for b in g] for g in ha.blocks] == [[b.block_id == 0 for b in g] for g in hb.blocks]
        num_new = min(chunk, ra.num_tokens - na)
        out_a, out_b = self.a.allocate_slots(ra, num_new, na, ha), self.b.allocate_slots(rb, num_new, nb, hb)
        assert (out_a is None) == (out_b is None) and out_a is not None
        assert [len(g) for g in out_a.blocks] == [len(g) for g in out_b.blocks]
        for r in (ra, rb):
            r.num_computed_tokens = na + num_new
            if r.num_computed_tokens == r.num_tokens:
                r.append_token_ids(50 + r.num_tokens % 3)
        self.running[rid] = (ra, rb)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def advance(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        ra, rb = self.running[rid]
        if ra.num_tokens >= 60:
            return self.finish_one(rid)
        num_new = min(chunk, ra.num_tokens - ra.num_computed_tokens)
        out_a, out_b = self.a.allocate_slots(ra, num_new), self.b.allocate_slots(rb, num_new)
        assert out_a is not None and out_b is not None
        assert [len(g) for g in out_a.blocks] == [len(g) for g in out_b.blocks]
        for r in (ra, rb):
            r.num_computed_tokens += num_new
            if r.num_computed_tokens == r.num_tokens:
                r.append_token_ids(50 + r.num_tokens % 3)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self.finish_one(data.draw(st.sampled_from(sorted(self.running))))

    def finish_one(self, rid):
        ra, rb = self.running.pop(rid)
        self.a.free(ra)
        self.b.free(rb)

    @invariant()
    def same_state(self):
        self.a.check_invariants()
        self.b.check_invariants()
        assert self.a.num_free_blocks == self.b.num_free_blocks
        assert self.a.pool.num_cached_blocks == self.b.pool.num_cached_blocks
        for rid in self.running:
            ia, ib = self.a.get_block_ids(rid), self.b.get_block_ids(rid)
            assert [[x == 0 for x in g] for g in ia] == [[x == 0 for x in g] for g in ib]

    def teardown(self):
        for rid in list(self.running):
            self.finish_one(rid)
        assert self.a.num_free_blocks == self.b.num_free_blocks == 1999


TestStripesVsGroups = pytest.mark.slow(StripesVsGroups.TestCase)
TestStripesVsGroups.settings = settings(
    max_examples=examples(120), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
