import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidConfigError,
    PoolTooSmallError,
    PromptTooLongError,
)
from hybridkv.scheduler import FakeRunner, FinishReason, SamplingParams, Scheduler, SchedulerConfig, fake_token

from tests.support.kv_specs import chunked, full, sliding
from tests.support.scheduler_driver import run
from tests.support.tiers import examples


def make(*specs, num_blocks=64, budget=16, max_seqs=8, max_len=128):
    kv = KVCacheManager(
        KVCacheConfig(num_blocks, tuple(KVCacheGroup(s) for s in specs)), CacheManagerConfig(max_model_len=max_len)
    )
    return Scheduler(kv, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len))


def test_chunked_prefill_then_decode():
    s = make(full(4), chunked(8), budget=8)
    s.add_request("a", list(range(10)), SamplingParams(max_tokens=2))
    trace, done = run(s)
    assert trace == [
        (0, [("a", 8, 0)], (), []),
        (1, [("a", 2, 8)], (), []),
        (2, [("a", 1, 10)], (), ["a"]),
    ]
    assert done["a"].output_token_ids == [fake_token("a", 0), fake_token("a", 1)]
    assert done["a"].finish_reason is FinishReason.LENGTH
    assert s.kv.num_free_blocks == 63


def test_preemption_of_the_most_recent_request_and_exact_recompute():
    # 7 usable blocks of 4 tokens; two 8-token prompts, 10 outputs each
    s = make(full(4), num_blocks=8, budget=16)
    s.add_request("A", list(range(8)), SamplingParams(max_tokens=10))
    s.add_request("B", list(range(100, 108)), SamplingParams(max_tokens=10))
    trace, done = run(s)
    assert trace[:6] == [
        (0, [("A", 8, 0), ("B", 8, 0)], (), []),
        (1, [("A", 1, 8), ("B", 1, 8)], (), []),
        (2, [("A", 1, 9), ("B", 1, 9)], (), []),
        (3, [("A", 1, 10), ("B", 1, 10)], (), []),
        (4, [("A", 1, 11), ("B", 1, 11)], (), []),
        # A needs its 4th block (7 used): B, the most recent, is preempted
        (5, [("A", 1, 12)], ("B",), []),
    ]
    assert trace[9] == (9, [("A", 1, 16)], (), ["A"])
    # B comes back: A's 5th block evicted B's deepest cached block (tokens 8-11), so
    # B hits its first 2 blocks (8 tokens) and recomputes the 5 tokens after them
    assert trace[10] == (10, [("B", 5, 8)], (), [])
    assert trace[-1] == (14, [("B", 1, 16)], (), ["B"])
    # a response reports the first admission's hit (vLLM's num_cached_tokens): none
    assert done["B"].num_preemptions == 1 and done["B"].num_cached_tokens == 0 and done["B"].last_hit_tokens == 8
    for rid in "AB":
        assert done[rid].output_token_ids == [fake_token(rid, i) for i in range(10)]
    assert s.num_preemptions == 1 and s.kv.num_free_blocks == 7


def test_shared_prefix_is_hit_by_later_requests():
    s = make(full(4), sliding(8), budget=64)
    system = list(range(40))
    s.add_request("a", system + [1, 2], SamplingParams(max_tokens=3))
    run(s)
    s.add_request("b", system + [7, 8, 9], SamplingParams(max_tokens=3))
    trace, done = run(s)
    assert done["b"].num_cached_tokens == 40
    assert trace[0][1] == [("b", 3, 40)]


def test_max_num_seqs_and_budget_limit_admission():
    s = make(full(4), budget=10, max_seqs=2)
    for i in range(3):
        s.add_request(f"r{i}", [i] * 4, SamplingParams(max_tokens=2))
    out = s.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in out.scheduled] == [("r0", 4), ("r1", 4)]
    assert s.num_waiting == 1


def test_stop_tokens_finish_early():
    s = make(full(4))
    stop = fake_token("a", 1)
    s.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
    _, done = run(s)
    assert done["a"].output_token_ids == [fake_token("a", 0), stop]
    assert done["a"].finish_reason is FinishReason.STOP


def test_max_model_len_ends_generation():
    s = make(full(4), max_len=12)
    s.add_request("a", list(range(10)), SamplingParams(max_tokens=100))
    _, done = run(s)
    assert done["a"].num_output_tokens == 2


def test_abort():
    s = make(full(4))
    s.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    s.add_request("b", [1, 2, 3], SamplingParams(max_tokens=5))
    s.step(FakeRunner())
    s.abort_request("a")
    s.abort_request("b") if s.sequences.get("b") else None
    s.check_invariants()
    assert s.kv.num_free_blocks == 63


def test_bad_requests_are_typed_errors_and_queue_nothing():
    s = make(full(4), num_blocks=5, max_len=64)
    s.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(DuplicateRequestError):
        s.add_request("a", [1])
    with pytest.raises(PromptTooLongError):
        s.add_request("long", list(range(65)))
    with pytest.raises(PoolTooSmallError):
        s.add_request("big", list(range(20)), SamplingParams(max_tokens=10))  # 30 tokens > 4 blocks
    assert s.num_waiting == 1
    with pytest.raises(InvalidConfigError):
        SchedulerConfig(max_num_batched_tokens=0)


def test_hybrid_request_longer_than_a_full_pool_would_allow():
    # chunked groups give blocks back as the request advances: 100 tokens need
    # 25 full blocks + at most 7 tokens of the current chunk + 16 new, from a chunk start
    # (aligned): cdiv(23, 4) = 6 chunked blocks
    s = make(full(4), chunked(8), num_blocks=40, budget=16)
    assert s.peak_blocks(100) == 25 + 6
    s.add_request("a", list(range(60)), SamplingParams(max_tokens=40))
    _, done = run(s)
    assert done["a"].num_output_tokens == 40


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=12),
    budget=st.integers(4, 40),
    num_blocks=st.integers(24, 60),
)
def test_random_workloads_finish_with_exact_outputs(prompts, budget, num_blocks):
    s = make(full(2), sliding(5, 2), chunked(6, 2), chunked(6, 2), num_blocks=num_blocks, budget=budget, max_len=64)
    bases = [list(range(50)), list(range(100, 150)), [7] * 50]
    accepted = {}
    for i, (base, length, max_tokens) in enumerate(prompts):
        try:
            s.add_request(f"r{i}", bases[base][:length] + [i], SamplingParams(max_tokens=max_tokens))
            accepted[f"r{i}"] = max_tokens
        except PoolTooSmallError:
            assert s.peak_blocks(length + 1 + max_tokens) > num_blocks - 1
    _, done = run(s)
    assert done.keys() == accepted.keys()
    for rid, max_tokens in accepted.items():
        assert done[rid].output_token_ids == [fake_token(rid, k) for k in range(max_tokens)]
    assert s.kv.num_free_blocks == num_blocks - 1


def test_sampling_params_eos_defaults_like_vllm():
    sp = SamplingParams(max_tokens=4, stop_token_ids=[9])
    assert sp.ignore_eos is False and sp.stop_token_ids == (9,)
    assert sp.with_eos([2, 9, 2]).stop_token_ids == (9, 2)
    ignoring = SamplingParams(stop_token_ids=(9,), ignore_eos=True)
    assert ignoring.with_eos([2]) is ignoring  # the request's own stop ids still hold
    assert sp.with_eos([]) is sp
    with pytest.raises(InvalidArgumentError, match="stop_token_ids must be non-negative ints"):
        SamplingParams(stop_token_ids=(1, -2))
