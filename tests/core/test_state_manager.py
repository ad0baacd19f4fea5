"""State groups (linear attention / SSM): tables, checkpoints, retention, deferred hits, and
a Hypothesis machine that runs a fake model over the tables and checks every state a step
continues from is the state after exactly the tokens before it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.core.managers.state import aligned_num_new_tokens
from hybridkv.core.specs import cdiv
from hybridkv.core.state_spec import StateSpec, gated_delta_net_state, mamba2_state, unify_page_sizes
from hybridkv.errors import InvalidConfigError, InvalidSpecError

from tests.support.kv_specs import full, state
from tests.support.state_machine import BS, StateMachine, manager
from tests.support.tiers import examples


def step(kv, req, n, hit=0, blocks=None):
    """One scheduler step of ``n`` tokens (aligned as the scheduler does); the tables after it."""
    kv.new_step_starts()
    n = kv.align_num_new_tokens(req, req.num_computed_tokens + hit, n)
    assert kv.allocate_slots(req, n, hit, blocks) is not None
    req.num_computed_tokens += hit + n
    kv.check_invariants()
    return n, kv.get_block_ids(req.request_id)


def cached_positions(kv, rid, group):
    """Positions of the request's table whose block is cached."""
    table = kv.get_blocks(rid).blocks[group]
    return [i for i, b in enumerate(table) if not b.is_null and b.block_hash is not None]


# ----------------------------------------------------------------------------- the worked example
def test_worked_example_dense():
    """The module docstring's table: block 4, a 14-token prompt (8, 4, 2), then two decodes."""
    kv = manager(full(4), state(4), retention=None)
    a = kv.make_request("a", list(range(14)))
    seen = []
    for n in (8, 6, 2):
        got, (attn, ssm) = step(kv, a, n)
        seen.append((got, list(attn), list(ssm)))
    assert [g for g, _, _ in seen] == [8, 4, 2]  # 8 -> 14 stops at 12, the prompt's last checkpoint
    s8, s12, s14 = (t[2] for t in seen)
    assert s8[0] == 0 and s8[1] != 0 and len(s8) == 2
    assert s12[:2] == s8[:2] and s12[2] not in (0, s8[1]) and len(s12) == 3
    assert s14[:3] == [0, 0, s12[2]] and s14[3] not in (0, s12[2])  # 3 freed, 5 kept to continue from
    assert cached_positions(kv, "a", 1) == [2]  # state after 12 (after 8: freed, still cached in the pool)
    for t in (100, 101):
        a.append_token_ids(t)
        step(kv, a, 1)
    ssm = kv.get_block_ids("a")[1]
    assert ssm[:3] == [0, 0, 0] and ssm[3] == s14[3]  # decodes in place; 16 tokens: block 3 is a checkpoint
    assert cached_positions(kv, "a", 1) == [3]
    kv.free(a)
    b = kv.make_request("b", list(range(14)) + [100, 101, 7])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 16 and [x.block_id for x in blocks.blocks[1]] == [0, 0, 0, s14[3]]
    c = kv.make_request("c", list(range(14)) + [9, 9, 9])
    blocks, hit = kv.get_computed_blocks(c)
    assert hit == 12 and [x.block_id for x in blocks.blocks[1]] == [0, 0, s12[2]]  # not downward closed: 8 unused
    kv.check_invariants()


@pytest.mark.parametrize("retention, want", [(None, [0, 1, 2, 3]), (0, [2]), (8, [1, 2, 3])])
def test_retention_interval_chooses_the_cached_checkpoints(retention, want):
    """Block 4, a 14-token prompt in steps of 4 then 2 decodes (16 tokens): checkpoints after
    4, 8, 12 and 16 tokens are written; which stay cached (position i = after 4(i+1))."""
    kv = manager(full(4), state(4), retention=retention)
    a = kv.make_request("a", list(range(14)))
    stored = set()
    for _ in range(4):
        step(kv, a, min(4, a.num_tokens - a.num_computed_tokens))
        stored |= set(cached_positions(kv, "a", 1))
    for t in (100, 101):
        a.append_token_ids(t)
        step(kv, a, 1)
        stored |= set(cached_positions(kv, "a", 1))
    # position 0 (after 4) is never cached: it is neither the prompt's last checkpoint (12) nor a multiple of 8
    assert sorted(stored) == want
    kv.check_invariants()


def test_a_hit_on_a_checkpoint_cached_this_step_waits_for_the_next_step():
    kv = manager(full(4), state(4), retention=None)
    a = kv.make_request("a", list(range(9)))
    kv.new_step_starts()
    assert kv.allocate_slots(a, 8) is not None  # caches the state after 8 (written by this step's model run)
    a.num_computed_tokens = 8
    b = kv.make_request("b", list(range(9)) + [5])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    free = kv.num_free_blocks
    assert kv.allocate_slots(b, b.num_tokens - hit, hit, blocks) is None  # same step: not yet written
    assert kv.num_free_blocks == free and not kv.has_request("b")
    kv.new_step_starts()
    blocks, hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None
    kv.check_invariants()


def test_the_pool_bound_is_two_state_blocks_per_group():
    s = state(4)
    assert s.max_num_blocks(1000, 64) == 2 and s.max_num_blocks(3, None) == 1
    kv = manager(full(4), state(4), state(4), num_blocks=200, retention=None)
    a = kv.make_request("a", list(range(50)))
    for n in (3, 17, 9, 21):
        step(kv, a, n)
        for table in kv.get_block_ids("a")[1:]:
            assert 1 <= sum(b != 0 for b in table) <= 2


# ----------------------------------------------------------------------------- aligned chunks
@settings(max_examples=examples(800), deadline=None)
@given(bs=st.integers(1, 8), prompt=st.integers(1, 60), extra=st.integers(0, 5), start=st.integers(0, 64),
       budget=st.integers(1, 40), step_budget=st.one_of(st.none(), st.integers(1, 40)), junction=st.integers(0, 16))
def test_aligned_chunks(bs, prompt, extra, start, budget, step_budget, junction):
    num_tokens = prompt + extra
    start = min(start, num_tokens - 1)
    n = min(budget, num_tokens - start)
    junction *= bs  # a hit length: whole blocks
    got = aligned_num_new_tokens(start, n, prompt, num_tokens, bs, step_budget, junction)
    assert 0 <= got <= n
    end = start + got
    prefill_end = max(prompt, num_tokens - 1)
    if start >= prefill_end:
        assert got == n
        return
    if got == 0:  # waits: a whole step could reach a boundary, this step's tokens cannot
        assert step_budget is not None and bs <= step_budget and (start + n) // bs * bs <= start
        assert start + n < prefill_end
        return
    last = (num_tokens - 1) // bs * bs
    if start < last:
        assert end <= last  # the prompt's last checkpoint is reached, not jumped over
    if start < junction:
        assert end <= junction  # and the shared-prefix junction
    if start % bs and end > cdiv(start, bs) * bs:
        raise AssertionError("a chunk starting inside a block ran past its end")
    if end < prefill_end and end % bs:
        # a chunk ends off a boundary only when it cannot reach one and the block is wider than a step
        assert end // bs * bs <= start and (step_budget is None or bs > step_budget)


# ----------------------------------------------------------------------------- specs
def test_qwen3_next_state_and_unified_pages():
    s = gated_delta_net_state(block_size=16, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                              conv_kernel=4, dtype="bfloat16")
    assert s.shapes == ((3, 8192), (32, 128, 128)) and s.real_page_size_bytes == 49_152 + 1_048_576
    attn = full(16).__class__(block_size=16, num_kv_heads=2, head_size=256, dtype="bfloat16")
    bs, (a,), (u,) = unify_page_sizes([attn], [s], block_size=16)
    assert bs == 544 and a.page_size_bytes == u.page_size_bytes == 1_114_112 and u.padding_bytes == 16_384
    m = mamba2_state(block_size=16, intermediate_size=8192, n_groups=8, state_size=128, num_heads=128, head_dim=64,
                     conv_kernel=4, dtype="bfloat16", ssm_dtype="float32")
    assert m.shapes == ((3, 10240), (128, 64, 128)) and m.dtypes == ("bfloat16", "float32")
    assert not attn.covers(s) and s.covers(s) and not s.covers(attn)


@pytest.mark.parametrize("kw", [
    dict(shapes=(), dtypes=()), dict(shapes=((0,),), dtypes=("float32",)), dict(shapes=((2,),), dtypes="float32"),
    dict(shapes=((2,),), dtypes=("float32", "float32")), dict(shapes=((2,),), dtypes=("int3",)),
    dict(shapes=((2,),), dtypes=("float32",), state_type="lstm"),
    dict(shapes=((2,),), dtypes=("float32",), page_size_padded=7),
])
def test_bad_state_specs(kw):
    with pytest.raises(InvalidSpecError):
        StateSpec(block_size=4, **kw)


@pytest.mark.parametrize("interval", [-1, 3, 2.0, "8", True])
def test_bad_retention_intervals(interval):
    with pytest.raises(InvalidConfigError):
        manager(full(4), state(4), retention=interval)


# ----------------------------------------------------------------------------- the fake-model machine
SETTINGS = settings(max_examples=examples(50), stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestStateMachine = StateMachine.TestCase
TestStateMachine.settings = SETTINGS


class RetainPromptOnlyMachine(StateMachine):
    RETENTION = 0
    STRIPE = False


TestRetainPromptOnly = RetainPromptOnlyMachine.TestCase
TestRetainPromptOnly.settings = SETTINGS


class EveryOtherBlockMachine(StateMachine):
    SPECS = (state(BS), full(BS), state(BS), state(BS))
    RETENTION = 2 * BS
    NUM_BLOCKS = 30


TestEveryOtherBlock = EveryOtherBlockMachine.TestCase
TestEveryOtherBlock.settings = SETTINGS


def test_a_shared_prefix_junction_gets_a_checkpoint():
    """Retention 0, block 4, a shared 8-token prefix S: A = S + 5 caches no checkpoint at 8
    (its prompt's last is at 12). B = S + 5 (another tail) finds full attention hitting 8
    tokens but no state there: its junction is 8, its prefill stops there and caches the
    state, so C = S + 5 hits 8 (vLLM gives the same)."""
    kv = manager(full(4), state(4), retention=0)
    shared = list(range(8))

    def admit(rid, tail, budget=64):
        req = kv.make_request(rid, shared + tail)
        kv.new_step_starts()
        blocks, hit = kv.get_computed_blocks(req)
        n = kv.align_num_new_tokens(req, hit, req.num_tokens - hit, budget)
        assert kv.allocate_slots(req, n, hit, blocks) is not None
        req.num_computed_tokens = hit + n
        while req.num_computed_tokens < req.num_tokens:
            step(kv, req, req.num_tokens - req.num_computed_tokens)
        kv.free(req)
        kv.check_invariants()
        return req, hit, n

    a, hit_a, first_a = admit("a", [20, 21, 22, 23, 24])
    assert hit_a == 0 and a.shared_prefix_boundary == 0 and first_a == 12  # stops at its last checkpoint
    b, hit_b, first_b = admit("b", [30, 31, 32, 33, 34])
    assert hit_b == 0 and b.shared_prefix_boundary == 8 and first_b == 8  # stops at the junction
    c, hit_c, _ = admit("c", [40, 41, 42, 43, 44])
    assert hit_c == 8 and c.shared_prefix_boundary == 0
