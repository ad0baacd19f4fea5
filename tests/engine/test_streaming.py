"""The engine's streaming step API, abort, and KV summary.

``step_deltas`` must hand out every output token exactly once, in order, with the
finish reported in the step that sampled the last token; ``abort_request`` frees the
request's blocks at once; bad ids are typed errors that change nothing. A seeded
random driver (arrivals, aborts at random steps, tiny pools that preempt) checks
the deltas against ``generate`` of the same prompts.
"""

from __future__ import annotations

import random

import pytest
from tests.support.tiers import slow_except

from hybridkv.engine.engine import EngineConfig, LLMEngine, RequestDelta
from hybridkv.engine.kv_summary import GroupUsage
from hybridkv.engine.models import load_model
from hybridkv.errors import DuplicateRequestError, InvalidArgumentError, PromptTooLongError, UnknownRequestError
from hybridkv.scheduler import SamplingParams


@pytest.fixture(scope="module")
def gemma(tiny_models):
    path, _ = tiny_models("gemma3")  # s s f s s f, window 12, vocab 128
    return load_model(path)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(128) for _ in range(n)]


def test_deltas_give_each_token_once_and_finish_in_the_last_step(gemma):
    engine = LLMEngine(gemma, EngineConfig(block_size=4, num_blocks=200, max_num_batched_tokens=9, max_model_len=128))
    rng = random.Random(1)
    prompts = {"a": _prompt(rng, 30), "b": _prompt(rng, 3), "c": _prompt(rng, 17)}
    want = {o.request_id: o for o in LLMEngine(gemma, EngineConfig(block_size=4, num_blocks=200)).generate(
        prompts.values(), SamplingParams(max_tokens=6))}
    for rid, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=6), request_id=rid)
    got: dict[str, list[int]] = {k: [] for k in prompts}
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        deltas = engine.step_deltas()
        steps += 1
        assert len({d.request_id for d in deltas}) == len(deltas)
        for d in deltas:
            assert isinstance(d, RequestDelta) and d.request_id not in finished
            assert d.new_token_ids or d.finished
            got[d.request_id] += d.new_token_ids
            if d.finished:
                finished[d.request_id] = d.output
                assert d.finish_reason == "length" and list(d.output.output_token_ids) == got[d.request_id]
        engine.scheduler.check_invariants()
    by_prompt = {rid: list(want[f"req-{i}"].output_token_ids) for i, rid in enumerate(prompts)}
    assert got == by_prompt and set(finished) == set(prompts)
    out = finished["a"]
    assert out.arrival_time <= out.first_token_time <= out.finished_time and out.time_to_first_token >= 0
    assert steps > 6  # the 30-token prompt took 4 prefill steps of 9 (chunked), then decodes
    assert engine.step_deltas() == []  # nothing left: an empty step


def test_abort_frees_blocks_at_once_and_unknown_ids_are_typed(gemma):
    engine = LLMEngine(gemma, EngineConfig(block_size=4, num_blocks=64, max_model_len=128))
    rng = random.Random(2)
    prompt_a = _prompt(rng, 40)
    a = engine.add_request(prompt_a, SamplingParams(max_tokens=20))
    b = engine.add_request(_prompt(rng, 9), SamplingParams(max_tokens=20))
    engine.step_deltas()
    engine.step_deltas()
    free = engine.kv.num_free_blocks
    out = engine.abort_request(a)
    assert out.finish_reason == "aborted" and len(out.output_token_ids) == 2 and out.prompt_token_ids == tuple(prompt_a)
    assert engine.kv.num_free_blocks > free and not engine.kv.has_request(a)
    engine.scheduler.check_invariants()
    for bad in (a, "nope", 3, None):
        with pytest.raises(UnknownRequestError):
            engine.abort_request(bad)
    # a waiting request aborts too (never admitted: no first token)
    c = engine.add_request(_prompt(rng, 5), SamplingParams(max_tokens=2))
    out = engine.abort_request(c)
    assert out.output_token_ids == () and out.first_token_time is None
    deltas = engine.step_deltas()
    assert [d.request_id for d in deltas] == [b]
    engine.scheduler.check_invariants()


def test_bad_requests_change_nothing(gemma):
    engine = LLMEngine(gemma, EngineConfig(block_size=4, num_blocks=64, max_model_len=32))
    engine.add_request([1, 2, 3], request_id="x")
    before = (engine.scheduler.num_waiting, dict(engine._progress))
    for args, err in [
        (([1] * 32,), PromptTooLongError),
        (([1, 2], None, "x"), DuplicateRequestError),
        (([1, 2], "greedy"), InvalidArgumentError),
        (([1, 2], None, 7), InvalidArgumentError),
        (([128],), InvalidArgumentError),
        (([],), InvalidArgumentError),
    ]:
        with pytest.raises(err):
            engine.add_request(*args)
        assert (engine.scheduler.num_waiting, dict(engine._progress)) == before
    with pytest.raises(InvalidArgumentError):
        engine.kv_summary(33)


@pytest.mark.parametrize("seed", slow_except(range(4), 0))
def test_random_arrivals_aborts_and_preemption_stream_what_generate_gives(gemma, seed):
    """Deltas of a run with aborts, arrivals and a tight pool == generate's tokens (aborted ones: a prefix)."""
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    prompts = [_prompt(rng, rng.choice([1, 2, 5, 13, 31, 44])) for _ in range(n)]
    max_tokens = [rng.randint(1, 9) for _ in range(n)]
    ref = LLMEngine(gemma, EngineConfig(block_size=4, num_blocks=300, max_model_len=64))
    want = [list(o.output_token_ids) for o in ref.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])]
    cfg = EngineConfig(block_size=rng.choice([1, 3, 4]), num_blocks=rng.randint(40, 70), max_model_len=64,
                       max_num_batched_tokens=rng.randint(1, 16), hybrid=rng.random() < 0.7)
    engine = LLMEngine(gemma, cfg)
    arrivals = {rng.randint(0, 8): [] for _ in range(n)}
    for i in range(n):
        arrivals.setdefault(rng.choice(list(arrivals)), []).append(i)
    got = {str(i): [] for i in range(n)}
    aborted, done = set(), set()
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i]), request_id=str(i))
        live = [r for r in engine.scheduler.sequences]
        if live and rng.random() < 0.08:
            rid = rng.choice(live)
            out = engine.abort_request(rid)
            assert list(out.output_token_ids) == got[rid]
            aborted.add(rid)
        for d in engine.step_deltas():
            got[d.request_id] += d.new_token_ids
            if d.finished:
                done.add(d.request_id)
        engine.scheduler.check_invariants()
        step += 1
        assert step < 2000
    for i in range(n):
        rid = str(i)
        if rid in aborted:
            assert got[rid] == want[i][: len(got[rid])]
        else:
            assert rid in done and got[rid] == want[i]
    summary = engine.kv_summary()
    assert all(g.blocks_in_use == 0 for g in summary.groups)  # everything freed
    assert summary.num_preemptions == engine.scheduler.num_preemptions


def test_kv_summary_groups_and_peaks(gemma):
    engine = LLMEngine(gemma, EngineConfig(block_size=4, num_blocks=200, max_model_len=128, max_num_batched_tokens=64))
    s0 = engine.kv_summary()
    assert s0.peak_blocks == 0 and s0.prefix_hit_tokens == 0 and s0.hybrid
    labels = sorted(g.label for g in s0.groups)
    assert labels == ["full", "sliding(12)", "sliding(12)"] and sum(g.num_layers for g in s0.groups) == 6
    prompt = list(range(1, 61))  # 60 tokens
    engine.generate([prompt], SamplingParams(max_tokens=4))
    engine.generate([prompt + [5]], SamplingParams(max_tokens=1))  # hits the 15 cached blocks of 60 tokens
    s = engine.kv_summary(64)
    full = next(g for g in s.groups if g.kind == "full_attention")
    assert full.peak_blocks == 16  # 61 tokens + 1 output, one prefill step: cdiv(62..64, 4) with the 64th unused
    # the sliding groups held the whole 60-token prompt during its one-step prefill, then dropped to the window
    assert all(g.peak_blocks == 15 for g in s.groups if g.kind == "sliding_window")
    assert s.prefix_hit_tokens == 60 and s.peak_blocks == 3 * 15  # the first prefill; the groups peak apart
    assert all(g.blocks_in_use == 0 for g in s.groups)
    assert isinstance(s.groups[0], GroupUsage)
    # per request at 64 tokens, budget 64: every group may hold all 16 blocks (no saving at this length)
    assert s.kv_bytes_per_request == s.full_kv_bytes_per_request == 16 * 6 * engine.grouping.page_size_bytes
    long = engine.kv_summary()  # at 128 tokens the window pays: full 32 + 2 * span(11 + 64) = 32 + 2 * 20
    assert long.kv_bytes_per_request == (32 + 2 * 20) * 2 * engine.grouping.page_size_bytes
    assert long.full_over_layout == pytest.approx(32 * 6 / (72 * 2))
