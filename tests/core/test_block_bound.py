"""The one per-request block bound (``spec.max_num_blocks(L, budget)``) against the real manager.

A request is driven through the manager the way a scheduler drives it (chunked prefill
of at most ``budget`` tokens a step, then decode, optionally after a prefix hit) and the
blocks it holds after every ``allocate_slots`` are counted: never above the bound, and
the bound is reached by some schedule (it is the tight maximum, not a loose guess).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    span_blocks,
    tail_only_blocks,
)
from hybridkv.errors import InvalidArgumentError, InvalidSpecError

from tests.support.kv_specs import chunked, full, sliding
from tests.support.tiers import examples, slow_except

SCOUT = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


def _held(kv: KVCacheManager, rid: str) -> int:
    (ids,) = kv.get_block_ids(rid)
    return sum(1 for b in ids if b != 0)


def _drive(spec, length: int, steps: list[int], *, hit_prefix: int = 0) -> int:
    """Blocks held at most while one ``length``-token request runs with ``steps`` new tokens per
    step (the last step repeats). With ``hit_prefix``, an earlier request caches that prefix first."""
    # without a warm prefix caching is off: a window of 1 would "hit" every token but the last
    kv = KVCacheManager(
        KVCacheConfig(4 * length + 8, (KVCacheGroup(spec),)),
        CacheManagerConfig(max_model_len=length, enable_caching=bool(hit_prefix)),
    )
    prompt = list(range(1, length + 1))
    if hit_prefix:
        warm = kv.make_request("warm", prompt[:hit_prefix] + [0])
        assert kv.allocate_slots(warm, warm.num_tokens) is not None
        warm.num_computed_tokens = warm.num_tokens
        kv.allocate_slots(warm, 0)  # cache the full blocks
        kv.free(warm)
    req = kv.make_request("r", prompt)
    hit_blocks, n = kv.get_computed_blocks(req)
    peak = 0
    i = 0
    first = True
    while n < length:
        k = min(steps[min(i, len(steps) - 1)], length - n)
        i += 1
        if first:
            assert kv.allocate_slots(req, k, n, hit_blocks) is not None
            first = False
        else:
            assert kv.allocate_slots(req, k) is not None
        peak = max(peak, _held(kv, "r"))
        n += k
        req.num_computed_tokens = n
        kv.check_invariants()
    kv.free(req)
    return peak


def _worst_case(spec, length: int, budget: int) -> int:
    """Max held over every point ``n`` at which a ``budget``-token step can start (1-token steps before)."""
    return max(_drive(spec, length, [1] * n + [budget]) for n in range(0, length - budget + 1))


SPECS = st.one_of(
    st.builds(full, bs=st.integers(1, 6)),
    st.builds(sliding, window=st.integers(1, 13), bs=st.integers(1, 6)),
    st.builds(chunked, chunk=st.integers(1, 13), bs=st.integers(1, 6)),
)


@settings(max_examples=examples(100), deadline=None)
@given(spec=SPECS, length=st.integers(1, 40), budget=st.integers(1, 12), data=st.data())
def test_no_schedule_exceeds_the_bound(spec, length, budget, data):
    steps = data.draw(st.lists(st.integers(1, budget), min_size=1, max_size=8))
    hit_prefix = data.draw(st.integers(0, length - 1))
    bound = spec.max_num_blocks(length, budget)
    assert _drive(spec, length, steps) <= bound
    assert _drive(spec, length, steps, hit_prefix=hit_prefix) <= bound


# the fast tier: span 6, block 4, budgets 2 and 7; the full suite: every combination
@pytest.mark.parametrize("bs", slow_except([1, 3, 4], 2))
@pytest.mark.parametrize("budget", slow_except([1, 2, 7], 1, 2))
@pytest.mark.parametrize("span", slow_except([1, 4, 6, 9], 2))
def test_the_bound_is_reached(bs, budget, span):
    """Long enough requests reach the bound exactly: it is the worst case, not slack."""
    length = 2 * (span + budget + 2 * bs)
    for spec in (sliding(span, bs), chunked(span, bs), full(bs)):
        assert _worst_case(spec, length, budget) == spec.max_num_blocks(length, budget), spec


def test_worked_examples_match_vllm_where_vllm_is_exact():
    # vLLM: sliding cdiv(W - 1 + budget, block) + 1; chunked cdiv(C + budget, block) (C a multiple of the block)
    assert SlidingWindowSpec(**SCOUT, sliding_window=1024).max_num_blocks(131072, 1024) == 129
    assert ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=256).max_num_blocks(131072, 512) == 48
    assert ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192).max_num_blocks(1 << 20, 2048) == 640
    assert ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192).max_num_blocks(1 << 20, 8192) == 1024
    # decode only: the window's 1023 tokens + the new one, from anywhere in a block
    assert SlidingWindowSpec(**SCOUT, sliding_window=1024).max_num_blocks(131072, 1) == 65
    assert ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192).max_num_blocks(1 << 20, 1) == 512
    # a chunk that is not a multiple of the block: chunk starts fall at offsets 0, 4 of a block of 8
    odd = ChunkedLocalAttentionSpec(block_size=8, num_kv_heads=1, head_size=1, attention_chunk_size=20)
    assert odd.max_num_blocks(1000, 8) == (4 + 19 + 8 - 1) // 8 + 1 == 4
    # never more than the request's own blocks; no budget = whole request in one step
    assert SlidingWindowSpec(**SCOUT, sliding_window=1024).max_num_blocks(100, 2048) == 7
    assert SlidingWindowSpec(**SCOUT, sliding_window=1024).max_num_blocks(1 << 20) == 65536
    assert FullAttentionSpec(**SCOUT).max_num_blocks(0, 4) == 0


def test_span_blocks():
    assert span_blocks(0, 16) == 0
    assert span_blocks(16, 16, 16) == 1 and span_blocks(16, 16) == 2 and span_blocks(1, 16) == 1
    assert span_blocks(25, 16, 16) == 2 and span_blocks(25, 16, 8) == 3 and span_blocks(17, 16, 4) == 2
    rnd = random.Random(0)
    for _ in range(500):  # brute force: every start offset a multiple of the alignment
        n, bs, a = rnd.randint(1, 40), rnd.randint(1, 9), rnd.randint(1, 20)
        worst = max((s + n - 1) // bs - s // bs + 1 for s in range(0, 4 * bs * a, a))
        assert span_blocks(n, bs, a) == worst


@pytest.mark.parametrize("bad", [-1, 1.5, True, None, "8"])
def test_bad_budget_or_length(bad):
    spec = SlidingWindowSpec(**SCOUT, sliding_window=1024)
    with pytest.raises(InvalidSpecError):
        spec.max_num_blocks(100, bad if bad is not None else 0)
    if bad is not None:
        with pytest.raises(InvalidSpecError):
            spec.max_num_blocks(bad, 16)


# ----------------------------------------------------------------- tail_only
TAIL_SPECS = st.one_of(
    st.builds(sliding, window=st.integers(1, 13), bs=st.integers(1, 6), tail_only=st.just(True)),
    st.builds(chunked, chunk=st.integers(1, 13), bs=st.integers(1, 6), tail_only=st.just(True)),
)


@settings(max_examples=examples(100), deadline=None)
@given(spec=TAIL_SPECS, length=st.integers(1, 60), budget=st.integers(1, 30), data=st.data())
def test_tail_only_never_exceeds_its_bound(spec, length, budget, data):
    steps = data.draw(st.lists(st.integers(1, budget), min_size=1, max_size=8))
    hit_prefix = data.draw(st.integers(0, length - 1))
    bound = spec.max_num_blocks(length, budget)
    assert bound <= replace(spec, tail_only=False).max_num_blocks(length, budget)
    assert _drive(spec, length, steps) <= bound
    assert _drive(spec, length, steps, hit_prefix=hit_prefix) <= bound


@pytest.mark.parametrize("bs", slow_except([1, 3, 4], 2))
@pytest.mark.parametrize("span", slow_except([1, 4, 6, 9], 2))
def test_tail_only_bound_is_reached_at_any_long_budget(bs, span):
    """Past a budget of a few spans the bound stops growing, and some schedule reaches it."""
    for make in (sliding, chunked):
        spec = make(span, bs, True)
        budgets = (3 * span + 2 * bs, 5 * span + 3 * bs)
        bounds = {spec.max_num_blocks(10 * (span + bs), b) for b in budgets}
        assert len(bounds) == 1, spec
        length = 2 * (budgets[0] + span + 2 * bs)
        # a chunked step's history and tail are both longest only for some step lengths
        worst = max(_worst_case(spec, length, b) for b in range(budgets[0] - span, budgets[0] + 1))
        assert worst == bounds.pop(), spec


def test_tail_only_worked_examples():
    gemma = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=256, sliding_window=512)
    assert gemma.max_num_blocks(32768, 2048) == 161
    assert replace(gemma, tail_only=True).max_num_blocks(32768, 2048) == 66 == tail_only_blocks(512, 16)
    assert replace(gemma, tail_only=True).max_num_blocks(32768, 1) == 33  # decode only: as before
    assert replace(gemma, tail_only=True).max_num_tokens(32768, 2048) == 1022
    scout = ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192, tail_only=True)
    assert scout.max_num_blocks(1 << 20, 8192) == 1024 and scout.max_num_blocks(1 << 20, 1 << 20) == 1024
    assert tail_only_blocks(1, 16) == 2 and tail_only_blocks(1, 1) == 1 and tail_only_blocks(20, 8, 20) == 3 + 3
    with pytest.raises(InvalidSpecError):
        SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=4, tail_only=1)


def test_tail_only_leaves_a_prefill_chunks_dead_blocks_unstored():
    """W 4, block 2, one 11-token step: positions [1, 4) (tokens 2-7) hold the null block, the
    rest are real; the next step makes them part of the skipped prefix."""
    spec = sliding(4, 2, True)
    kv = KVCacheManager(KVCacheConfig(20, (KVCacheGroup(spec),)), CacheManagerConfig(max_model_len=32))
    req = kv.make_request("r", list(range(1, 14)))
    free = kv.num_free_blocks
    assert kv.allocate_slots(req, 1) is not None  # token 0
    req.num_computed_tokens = 1
    assert kv.allocate_slots(req, 10) is not None  # tokens 1-10
    (ids,) = kv.get_block_ids("r")
    assert [i != 0 for i in ids] == [True, False, False, False, True, True]
    assert free - kv.num_free_blocks == 3
    kv.check_invariants()
    req.num_computed_tokens = 11
    assert kv.allocate_slots(req, 2) is not None  # tokens 11-12: blocks 0-3 skipped
    (ids,) = kv.get_block_ids("r")
    assert [i != 0 for i in ids] == [False] * 4 + [True] * 3
    kv.check_invariants()
    kv.free(req)
    assert kv.num_free_blocks == free


def test_tail_only_refills_a_gap_a_rerun_needs():
    """A step [1, 11) whose tokens were never counted (a failed step) re-run shorter: the gap's
    positions are needed again and get blocks; moving past the gap without running it is refused."""
    spec = sliding(4, 2, True)
    kv = KVCacheManager(KVCacheConfig(20, (KVCacheGroup(spec),)), CacheManagerConfig(max_model_len=32))
    req = kv.make_request("r", list(range(1, 14)))
    kv.allocate_slots(req, 1)
    req.num_computed_tokens = 1
    kv.allocate_slots(req, 10)
    req.num_computed_tokens = 6  # tokens 2-5 sit in the gap, never stored: token 6 reads 3-5
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(req, 1)
    req.num_computed_tokens = 1
    assert kv.allocate_slots(req, 3) is not None  # [1, 4): no gap, the old one filled
    (ids,) = kv.get_block_ids("r")
    assert 0 not in ids
    kv.check_invariants()
