"""Admission as vLLM admits by default (the whole prompt must fit), the first-chunk
alternative, the max_model_len clamp, and random tight-pool workloads under both.

``benchmarks/vs_vllm_scheduler.py`` compares these decisions with vLLM 0.33's own
scheduler step by step; these tests pin small cases by hand.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, PoolTooSmallError, PromptTooLongError
from hybridkv.scheduler import FakeRunner, FinishReason, SamplingParams, Scheduler, SchedulerConfig, fake_token
from hybridkv.scheduler.simulator import simulate
from hybridkv.scheduler.workloads import TraceRequest

from tests.support.kv_specs import chunked, full, sliding, state
from tests.support.scheduler_driver import run
from tests.support.tiers import examples


def make(*specs, num_blocks=64, budget=16, max_seqs=8, max_len=128, admission="full_prompt", caching=True,
         queued_prefix="none"):
    kv = KVCacheManager(
        KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs)),
        CacheManagerConfig(max_model_len=max_len, enable_caching=caching),
    )
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len,
                             admission=admission, queued_prefix=queued_prefix)
    return Scheduler(kv, config)


def test_full_prompt_is_the_default_and_bad_policies_are_refused():
    assert SchedulerConfig().admission == "full_prompt"
    for bad in ("first-chunk", "", None, 1, "FULL_PROMPT"):
        with pytest.raises(InvalidConfigError, match="admission must be one of"):
            SchedulerConfig(admission=bad)


def _gate_case(admission):
    # 7 usable blocks of 4 tokens. A (8 tokens, 6 outputs) runs; B (20 tokens = 5 blocks)
    # arrives beside it. At step 1 A holds 3 blocks: 4 are free, enough for B's first
    # chunk (7 tokens, 2 blocks) but not for its whole prompt (5 blocks).
    s = make(full(4), num_blocks=8, budget=8, max_len=64, admission=admission)
    s.add_request("A", list(range(8)), SamplingParams(max_tokens=6))
    s.add_request("B", list(range(100, 120)), SamplingParams(max_tokens=2))
    return s, *run(s)


def test_full_prompt_admission_waits_until_the_whole_prompt_fits():
    s, trace, done = _gate_case("full_prompt")
    assert trace == [
        (0, [("A", 8, 0)], (), []),
        (1, [("A", 1, 8)], (), []),  # B waits: 5 blocks needed, 4 free
        (2, [("A", 1, 9)], (), []),
        (3, [("A", 1, 10)], (), []),
        (4, [("A", 1, 11)], (), []),
        (5, [("A", 1, 12)], (), ["A"]),
        (6, [("B", 8, 0)], (), []),  # A's 4 blocks are back: 7 free
        (7, [("B", 8, 8)], (), []),
        (8, [("B", 4, 16)], (), []),
        (9, [("B", 1, 20)], (), ["B"]),
    ]
    assert s.num_preemptions == 0


def test_first_chunk_admission_starts_early_then_preempts():
    s, trace, done = _gate_case("first_chunk")
    assert trace == [
        (0, [("A", 8, 0)], (), []),
        (1, [("A", 1, 8), ("B", 7, 0)], (), []),  # B's first chunk fits: admitted
        (2, [("A", 1, 9), ("B", 7, 7)], (), []),  # the pool is now full
        (3, [("A", 1, 10)], ("B",), []),  # B's 3rd chunk needs a 5th block: B preempts itself
        (4, [("A", 1, 11)], (), []),
        (5, [("A", 1, 12)], (), ["A"]),
        (6, [("B", 8, 12)], (), []),  # back with its 3 cached full blocks as a hit
        (7, [("B", 1, 20)], (), ["B"]),
    ]
    assert s.num_preemptions == 1 and done["B"].num_cached_tokens == 0 and done["B"].last_hit_tokens == 12
    for rid, n in (("A", 6), ("B", 2)):
        assert done[rid].output_token_ids == [fake_token(rid, k) for k in range(n)]


def test_windowed_groups_count_at_most_their_per_request_bound():
    # full + chunked 8, block 4, budget 4: the chunked group holds at most
    # ChunkedLocalAttentionSpec.max_num_blocks(L, 4) = 3 blocks, so a 19-token prompt
    # needs 5 + 3 = 8 blocks to be admitted, not 5 + 5, and an 8-block pool runs it.
    s = make(full(4), chunked(8), num_blocks=9, budget=4, max_len=64)
    assert chunked(8).max_num_blocks(64, 4) == 3
    seq = s.add_request("a", list(range(19)), SamplingParams(max_tokens=1))
    assert s.blocks_to_admit(seq.request) == 8
    trace, done = run(s)
    assert [t[1] for t in trace] == [[("a", 4, 0)], [("a", 4, 4)], [("a", 4, 8)], [("a", 4, 12)], [("a", 3, 16)]]
    assert done["a"].num_output_tokens == 1
    # sliding 5 (block 4, budget 4): 4 kept + 4 new tokens from anywhere in a block → 3 blocks
    s = make(full(4), sliding(5), num_blocks=64, budget=4, max_len=64)
    seq = s.add_request("b", list(range(30)), SamplingParams(max_tokens=1))
    assert s.blocks_to_admit(seq.request) == 8 + sliding(5).max_num_blocks(64, 4) == 8 + 3


def test_blocks_to_admit_counts_a_hit_like_an_allocation():
    # a's 3 full blocks are cached. While a runs they are held: b (same 12 tokens + 6)
    # needs only its 2 new blocks; once a is done they are free and cached, and
    # adopting them takes them from the free queue: 2 + 3.
    s = make(full(4), num_blocks=16, budget=64)
    s.add_request("a", list(range(12)) + [99], SamplingParams(max_tokens=3))
    s.step(FakeRunner())
    b = s.kv.make_request("b", list(range(12)) + [5] * 6)
    hit, n = s.kv.get_computed_blocks(b)
    assert n == 12 and s.blocks_to_admit(b, hit, n) == 2
    assert s.blocks_to_admit(b) == 5  # no hit passed: every block is new
    with pytest.raises(InvalidArgumentError, match="already holds blocks"):
        s.blocks_to_admit(s.running[0].request)  # a runs: nothing to admit
    run(s)
    hit, n = s.kv.get_computed_blocks(b)
    assert n == 12 and s.blocks_to_admit(b, hit, n) == 2 + 3


def test_prompt_must_leave_room_for_one_output_token():
    # vLLM refuses a prompt of max_model_len tokens (the sampled token would not fit)
    s = make(full(4), max_len=12, budget=3)
    with pytest.raises(PromptTooLongError, match="leaves no room for an output token"):
        s.add_request("x", list(range(12)))
    assert s.num_waiting == 0
    # 11 tokens: chunks of 3 up to max_model_len - 1, one output token, finished at 12
    s.add_request("a", list(range(11)), SamplingParams(max_tokens=100))
    trace, done = run(s)
    assert [t[1] for t in trace] == [[("a", 3, 0)], [("a", 3, 3)], [("a", 3, 6)], [("a", 2, 9)]]
    assert done["a"].num_output_tokens == 1 and done["a"].finish_reason is FinishReason.LENGTH


def test_new_tokens_are_clamped_below_max_model_len():
    # vLLM schedules at most max_model_len - computed - 1 tokens for a running request.
    # A request can only get more tokens than that through its token list (as spec
    # decoding would); append them by hand: max_model_len 8, 5 computed, 8 known.
    s = make(full(4), max_len=8, budget=8)
    seq = s.add_request("a", list(range(5)), SamplingParams(max_tokens=2))
    s.schedule()  # prefill 0-4
    seq.request.append_token_ids([1, 2, 3])  # 8 tokens known, 5 computed: 3 due, 2 allowed
    out = s.schedule()
    assert [(r.request_id, len(r.token_ids), r.num_computed_tokens) for r in out.scheduled] == [("a", 2, 5)]
    assert seq.request.num_computed_tokens == 7 == 8 - 1  # never max_model_len
    s.check_invariants()


def test_simulation_reports_the_policy_it_modelled():
    cfg = KVCacheConfig(40, (KVCacheGroup(full(4)), KVCacheGroup(chunked(8))))
    trace = [TraceRequest(f"r{i}", i, tuple(range(i, i + 20)), 4) for i in range(6)]
    for admission in ("full_prompt", "first_chunk"):
        res = simulate("x", cfg, trace, SchedulerConfig(max_num_batched_tokens=8, max_model_len=64,
                                                        admission=admission), check_invariants_every=1)
        assert res.summary()["admission"] == admission and res.finished == 6


# ------------------------------------------------------------------ random workloads
LAYOUTS = [
    lambda bs, w, c: (full(bs),),
    lambda bs, w, c: (full(bs), sliding(w, bs)),
    lambda bs, w, c: (full(bs), chunked(c, bs), chunked(c, bs), chunked(c, bs)),
    lambda bs, w, c: (full(bs), sliding(w, bs), chunked(c, bs), chunked(c, bs)),
    lambda bs, w, c: (state(bs), full(bs), state(bs), state(bs)),  # Qwen3-Next-shaped
    lambda bs, w, c: (sliding(w, bs), state(bs)),
]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.integers(0, len(LAYOUTS) - 1),
    bs=st.integers(1, 5),
    window=st.integers(1, 12),
    chunk=st.integers(1, 12),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    extra=st.integers(0, 12),
    admission=st.sampled_from(["full_prompt", "first_chunk"]),
    caching=st.booleans(),
    queued_prefix=st.sampled_from(["none", "refresh", "pin"]),
    seed=st.integers(0, 10**6),
)
def test_random_tight_pools_finish_exactly_and_hold_invariants(
    layout, bs, window, chunk, budget, max_seqs, extra, admission, caching, queued_prefix, seed
):
    rng = random.Random(seed)
    specs = LAYOUTS[layout](bs, window, chunk)
    max_len = 40
    bases = [[rng.randrange(50) for _ in range(max_len)] for _ in range(2)]
    reqs = []
    for i in range(rng.randint(1, 9)):
        plen = rng.randint(1, 30)
        prompt = bases[rng.randrange(2)][: plen - 1] + [100 + i]  # shared prefixes: hits
        reqs.append((rng.randint(0, 8), f"r{i}", prompt, rng.randint(1, 9)))
    probe = make(*specs, num_blocks=10_000, budget=budget, max_len=max_len)
    # tight: the biggest request just fits, plus a few blocks
    num_blocks = 1 + max(probe.peak_blocks(min(len(p) + m, max_len)) for _, _, p, m in reqs) + extra
    s = make(*specs, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, max_len=max_len,
             admission=admission, caching=caching, queued_prefix=queued_prefix)
    usable = num_blocks - 1
    runner = FakeRunner()
    pending = sorted(reqs)
    done = {}
    while pending or s.has_unfinished_requests():
        while pending and pending[0][0] <= s.step_count:
            _, rid, prompt, max_tokens = pending.pop(0)
            s.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
        out, fin = s.step(runner)
        s.check_invariants()
        assert out.num_scheduled_tokens <= budget and s.num_running <= max_seqs
        assert all(r.num_computed_tokens + len(r.token_ids) < max_len for r in out.scheduled)
        held = {i for seq in s.running for ids in s.kv.get_block_ids(seq.request_id) for i in ids if i}
        held |= set(s.kv.pins.ref_counts())  # and queued requests' pinned prefix hits
        assert len(held) == usable - s.kv.num_free_blocks <= usable  # running requests hold every used block
        done.update((f.request_id, f) for f in fin)
        assert out.step < 2000, "did not finish"
    assert len(done) == len(reqs)
    for _, rid, prompt, max_tokens in reqs:
        n = min(max_tokens, max_len - len(prompt))
        assert done[rid].output_token_ids == [fake_token(rid, k) for k in range(n)]
    assert s.kv.num_free_blocks == usable and not s.kv.pins


def test_a_request_that_can_never_be_admitted_is_refused_up_front():
    # the gate never waits forever: add_request refuses what an empty pool could not run
    s = make(full(4), num_blocks=6, budget=4, max_len=64)
    with pytest.raises(PoolTooSmallError):
        s.add_request("big", list(range(20)), SamplingParams(max_tokens=2))  # 22 tokens: 6 blocks > 5
    s.add_request("ok", list(range(19)), SamplingParams(max_tokens=1))  # 20 tokens: 5 blocks
    _, done = run(s)
    assert done["ok"].num_output_tokens == 1
