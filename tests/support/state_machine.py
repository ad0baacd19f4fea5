"""A scheduler-like driver over full + sliding + state groups with a fake model, as a
hypothesis state machine (the state-manager tests run it; the router's index tests replay
its KV events)."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.specs import cdiv

from tests.support.kv_specs import full, sliding, state


def manager(*specs, num_blocks=64, retention=0, stripe=True, max_model_len=200):
    cfg = KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs))
    return KVCacheManager(cfg, CacheManagerConfig(max_model_len=max_model_len, prefix_cache_retention_interval=retention,
                                                  stripe_groups=stripe))


BS = 2
PREFIXES = [list(range(1, 16)), [1, 2, 3, 4, 20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36]]


class StateMachine(RuleBasedStateMachine):
    """Steps of a scheduler over full + sliding + state groups with a fake model: a block's
    content is what the model wrote there (attention: a block's tokens; state: the tokens the
    state has seen). Before each step's model run, every block the step reads must hold the
    request's own tokens: attention blocks in its window, and the state block it continues
    from the state after exactly its computed tokens (a hit restored from a checkpoint too)."""

    SPECS = (full(BS), state(BS), sliding(3, BS), state(BS))
    RETENTION = None
    STRIPE = True
    NUM_BLOCKS = 36

    def __init__(self):
        super().__init__()
        self.kv = manager(*self.SPECS, num_blocks=self.NUM_BLOCKS, retention=self.RETENTION, stripe=self.STRIPE,
                          max_model_len=64)
        self.specs = self.SPECS
        self.content: dict[int, tuple] = {}
        self.waiting: dict[str, object] = {}
        self.running: dict[str, object] = {}
        self.next_id = 0

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 15), tail=st.lists(st.integers(40, 45), max_size=5))
    def add_request(self, prefix, cut, tail):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[rid] = self.kv.make_request(rid, PREFIXES[prefix][:cut] + tail)

    @rule(data=st.data(), budget=st.integers(1, 12), align=st.booleans())
    def step(self, data, budget, align):
        full_budget = budget
        kv = self.kv
        kv.new_step_starts()
        work = []  # (request, tokens computed before, new tokens)
        for rid in sorted(self.running):
            req = self.running[rid]
            if budget <= 0 or not data.draw(st.booleans()):
                continue
            n = req.num_computed_tokens
            if req.num_tokens >= 60:
                self._free(rid)
                continue
            num_new = min(budget, req.num_tokens - n)
            if align:
                num_new = kv.align_num_new_tokens(req, n, num_new, full_budget)
                if num_new == 0:
                    continue
            if kv.allocate_slots(req, num_new) is None:
                self._free(rid, preempt=True)
                continue
            work.append((req, n, num_new))
            budget -= num_new
        for rid in sorted(self.waiting):
            if budget <= 0 or not data.draw(st.booleans()):
                continue
            req = self.waiting[rid]
            blocks, hit = kv.get_computed_blocks(req)
            num_new = min(budget, req.num_tokens - hit)
            if align:
                num_new = kv.align_num_new_tokens(req, hit, num_new, full_budget)
                if num_new == 0:
                    continue
            if kv.allocate_slots(req, num_new, hit, blocks) is None:
                assert not kv.has_request(rid)
                continue
            del self.waiting[rid]
            self.running[rid] = req
            work.append((req, hit, num_new))
            budget -= num_new
        kv.check_invariants()
        self._run_model(work)

    def _run_model(self, work):
        writes = []
        for req, n, num_new in work:
            tokens = req.all_token_ids
            m = n + num_new
            for spec, table in zip(self.SPECS, self.kv.get_block_ids(req.request_id)):
                assert len(table) == cdiv(m, BS) or spec.kind != "mamba", (table, n, m)
                if spec.kind == "mamba":
                    if n:
                        src = table[cdiv(n, BS) - 1]
                        assert src != 0 and self.content.get(src) == ("state", tuple(tokens[:n])), (n, table)
                    dst = table[cdiv(m, BS) - 1]
                    assert dst != 0
                    writes.append((dst, ("state", tuple(tokens[:m]))))
                    continue
                first = 0 if spec.kind == "full_attention" else max(0, n - spec.sliding_window + 1)
                for i in range(first // BS, cdiv(n, BS)):  # blocks of earlier tokens it reads
                    got = self.content.get(table[i])
                    assert table[i] != 0 and got is not None and got[1] == tuple(tokens[i * BS:min((i + 1) * BS, n)])[:len(got[1])]
                for i in range(n // BS, cdiv(m, BS)):  # blocks it writes
                    writes.append((table[i], ("kv", tuple(tokens[i * BS:min((i + 1) * BS, m)]))))
        for block, value in writes:  # after every read: the step's model run
            self.content[block] = value
        for req, n, num_new in work:
            req.num_computed_tokens = n + num_new
            if req.num_computed_tokens == req.num_tokens:
                req.append_token_ids(50 + req.num_tokens % 3)

    def _free(self, rid, preempt=False):
        req = self.running.pop(rid)
        self.kv.free(req)
        if preempt:
            req.num_computed_tokens = 0
            self.waiting[rid] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.running))))

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        for rid in self.running:
            for spec, table in zip(self.SPECS, self.kv.get_block_ids(rid)):
                if spec.kind == "mamba":
                    assert sum(b != 0 for b in table) <= 2

    def teardown(self):
        for rid in list(self.running):
            self._free(rid)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.NUM_BLOCKS - 1
