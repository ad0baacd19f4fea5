"""Random add / allocate / cache / free / evict sequences on a hybrid manager (full + sliding
window + chunked local), as hypothesis state machines: the core tests run them, the router's
index and the KV-event replay tests drive their event streams."""

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.specs import cdiv

from tests.support.kv_specs import chunked, full, sliding

BS = 2
WINDOW = 5
CHUNK = 6  # not a multiple of... BS 2 divides it; the straddle case is covered by CHUNK2
CHUNK2 = 5
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 20, 21, 22, 23], [30, 31, 32, 33, 34, 35]]


class HybridManagerMachine(RuleBasedStateMachine):
    # chunked(CHUNK) twice, not adjacent: one manager, stripes of 2
    SPECS = (full(BS), sliding(WINDOW, BS), chunked(CHUNK, BS), chunked(CHUNK2, BS), chunked(CHUNK, BS))
    NUM_BLOCKS = 40

    def __init__(self):
        super().__init__()
        specs = self.SPECS
        cfg = KVCacheConfig(self.NUM_BLOCKS, tuple(KVCacheGroup(s) for s in specs))
        self.kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=64))
        self.waiting: dict[str, object] = {}
        self.running: dict[str, object] = {}
        self.next_id = 0
        self.specs = specs

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 13), tail=st.lists(st.integers(40, 45), max_size=6))
    def add_request(self, prefix, cut, tail):
        prompt = PREFIXES[prefix][:cut] + tail
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[rid] = self.kv.make_request(rid, prompt)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        req = self.waiting[rid]
        blocks, n = self.kv.get_computed_blocks(req)
        assert n % BS == 0 and n < req.num_tokens
        num_new = min(chunk, req.num_tokens - n)
        free_before = self.kv.num_free_blocks
        new = self.kv.allocate_slots(req, num_new, n, blocks)
        if new is None:
            assert self.kv.num_free_blocks == free_before and not self.kv.has_request(rid)
            return
        self._check_readable(rid, n, num_new)
        req.num_computed_tokens = n + num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_token_ids(50 + req.num_tokens % 3)
        del self.waiting[rid]
        self.running[rid] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def advance(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if req.num_tokens >= 60:
            return self._free(rid)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        tables_before = self.kv.get_block_ids(rid)
        lengths_before = [len(t) for t in tables_before]
        new = self.kv.allocate_slots(req, num_new)
        if new is None:
            # only dead blocks may have been released; the table keeps its length
            assert [len(t) for t in self.kv.get_block_ids(rid)] == lengths_before
            return self._free(rid, preempt=True)
        self._check_readable(rid, req.num_computed_tokens, num_new)
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_token_ids(50 + req.num_tokens % 3)

    def _check_readable(self, rid, n, num_new):
        """The tokens about to be computed (n .. n+num_new-1) can read every block they attend to
        (tail_only: the blocks before n; of their own, those later tokens read, which are stored)."""
        e = n + num_new
        for spec, table in zip(self.specs, self.kv.get_block_ids(rid)):
            assert len(table) >= cdiv(e, BS)
            first, dead_after = _first_key(spec, n), _first_key(spec, e)
            if not getattr(spec, "tail_only", False):
                assert 0 not in table[first // BS:cdiv(e, BS)], (spec.kind, n, num_new, table)
                continue
            assert 0 not in table[first // BS:cdiv(n, BS)], (spec.kind, n, num_new, table)
            tail = max(cdiv(n, BS), min(dead_after // BS, (e - 1) // BS))
            assert 0 not in table[tail:cdiv(e, BS)], (spec.kind, n, num_new, table)
            # and only those: a new position wholly dead at e holds no block (unless held from before)
            self.gap_seen |= 0 in table[cdiv(n, BS):tail]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.running))))

    def _free(self, rid, preempt=False):
        req = self.running.pop(rid)
        self.kv.free(req)
        if preempt:
            req.num_computed_tokens = 0
            self.waiting[rid] = req

    @rule()
    def reset_cache_when_idle(self):
        assert self.kv.reset_prefix_cache() == (not self.running)

    @invariant()
    def consistent(self):
        self.kv.check_invariants()

    gap_seen = False

    @invariant()
    def tables_hold_exactly_what_attention_needs(self):
        for rid, req in self.running.items():
            n = req.num_computed_tokens
            for spec, table in zip(self.specs, self.kv.get_block_ids(rid)):
                assert len(table) >= cdiv(n, BS)
                dead = _first_key(spec, n) // BS
                # allocate_slots frees lazily (at the next call), so up to `dead` may be null
                assert all(b != 0 for b in table[dead:]), (spec.kind, n, table)
                # every block a future token can read is live
                live_from = dead
                assert 0 not in table[live_from:cdiv(n, BS)]

    def teardown(self):
        for rid in list(self.running):
            self._free(rid)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.NUM_BLOCKS - 1
        assert self.kv.usage == 0.0


def _first_key(spec, n: int) -> int:
    """The first token a query at position ``n`` reads under ``spec``."""
    if spec.kind == "full_attention":
        return 0
    if spec.kind == "sliding_window":
        return max(0, n - spec.sliding_window + 1)
    return n // spec.attention_chunk_size * spec.attention_chunk_size


class TailOnlyMachine(HybridManagerMachine):
    """The hybrid machine with ``tail_only`` windowed groups (stripes of 2 and 1), a plain
    sliding group beside them: a step's dead new blocks are never stored."""

    SPECS = (full(BS), sliding(WINDOW, BS, True), chunked(CHUNK, BS, True), chunked(CHUNK2, BS, True),
             chunked(CHUNK, BS, True), sliding(3, BS, True), sliding(WINDOW, BS))
    NUM_BLOCKS = 48


class MixedStripeWidthsMachine(HybridManagerMachine):
    """Stripes of 3 (chunked) and 2 (sliding) beside plain full blocks, 7 blocks per
    position in a pool of 48: entries of three widths are unmade and bound all the time."""

    SPECS = (chunked(CHUNK2, BS), full(BS), sliding(WINDOW, BS), chunked(CHUNK2, BS), sliding(WINDOW, BS),
             chunked(CHUNK2, BS), chunked(CHUNK, BS))
    NUM_BLOCKS = 48
