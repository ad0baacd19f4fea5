"""Logit bias, min_tokens and the repetition / frequency / presence penalties (vLLM's rules).

A plain-Python fp64 reference of each rule against the batched application on random logits,
histories and parameters at their range edges, rows with and without penalties mixed; a row's
result independent of its batch; both sampler paths; the neutral fast path; validation; fault
rows; and through the real engine on a tiny model against transformers (``min_new_tokens``,
``repetition_penalty``, and a reference loop over HF's logits for frequency / presence / bias).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples

from hybridkv.engine.penalties import adjusts, apply_penalties
from hybridkv.engine.sampling import FAULT, Sampler
from hybridkv.errors import InvalidArgumentError
from hybridkv.sampling_params import SamplingParams

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny
INF = math.inf


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One row's logits after bias, min_tokens, repetition, frequency, presence: plain Python, fp64."""
    x = list(row)
    vocab = len(x)
    for t, bias in p.logit_bias:
        x[t] += bias
    if len(output) < p.min_tokens:
        for t in p.stop_token_ids:
            if t < vocab and not (math.isnan(x[t]) or x[t] == INF):  # a model fault stays one
                x[t] = -INF
    r = _f32(min(max(p.repetition_penalty, F32_TINY), F32_MAX))
    for t in set(prompt) | set(output):
        y = x[t] / r if x[t] > 0 else x[t] * r
        x[t] = min(max(y, -F32_MAX), F32_MAX) if math.isfinite(x[t]) else y  # saturates in fp32
    for t, count in Counter(output).items():
        x[t] -= p.frequency_penalty * count
        x[t] -= p.presence_penalty
    return x


# ------------------------------------------------------------------ strategies
edge_penalty = st.sampled_from([-2.0, 2.0, 0.0, -0.0]) | st.floats(-2.0, 2.0)
edge_repetition = st.sampled_from([1.0, 2.0, 1e-300, 1e-45, 1e-20, 1e30, 1e300]) | st.floats(0.05, 20.0)
edge_bias = st.sampled_from([-100.0, 100.0, 0.0]) | st.floats(-100.0, 100.0)


@st.composite
def rows(draw, vocab: int):
    """(params, prompt, output) of one row; a third of them neutral."""
    prompt = draw(st.lists(st.integers(0, vocab - 1), max_size=12))
    output = draw(st.lists(st.integers(0, vocab - 1), max_size=12))
    greedy = draw(st.booleans())
    sampling = dict(temperature=0.0) if greedy else dict(temperature=draw(st.sampled_from([0.7, 1.3])),
                                                           seed=draw(st.integers(0, 2**40)))
    if draw(st.integers(0, 2)) == 0:
        return SamplingParams(max_tokens=64, **sampling), prompt, output
    params = SamplingParams(
        max_tokens=64,
        presence_penalty=draw(st.sampled_from([0.0]) | edge_penalty),
        frequency_penalty=draw(st.sampled_from([0.0]) | edge_penalty),
        repetition_penalty=draw(st.sampled_from([1.0]) | edge_repetition),
        logit_bias=draw(st.dictionaries(st.integers(0, vocab - 1), edge_bias, max_size=4)),
        min_tokens=draw(st.integers(0, len(output) + 2)),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, vocab + 3), max_size=3))),  # some outside the vocabulary
        **sampling,
    )
    return params, prompt, output


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 24))
    n = draw(st.integers(1, 6))
    scale = draw(st.sampled_from([1.0, 30.0, 1e30]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(n, vocab, generator=gen) * scale
    if draw(st.booleans()):  # the model's own -inf (a padded vocabulary)
        logits[:, 0] = -INF
    return logits, [draw(rows(vocab)) for _ in range(n)]


def _apply(logits, batch, sampler: Sampler | None = None):
    params = [p for p, _, _ in batch]
    counts = [len(o) for _, _, o in batch]
    history = [pr + o + [0, 0] for _, pr, o in batch]  # the rest of the list is not read
    prompts = [len(pr) for _, pr, _ in batch]
    if sampler is None:
        return apply_penalties(logits, params, counts, history, prompts)
    return sampler.sample_rows(logits, params, counts, history, prompts)


# ------------------------------------------------------------ reference rules
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_batched_application_matches_the_fp64_reference(case):
    logits, batch = case
    got = _apply(logits, batch)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    for i, (p, prompt, output) in enumerate(batch):
        want = torch.tensor(reference(logits[i].double().tolist(), p, prompt, output), dtype=torch.float64)
        if not adjusts(p, len(output)):
            assert torch.equal(got[i], logits[i]), "a row without adjustments must come out bit-identical"
            continue
        torch.testing.assert_close(got[i].double(), want, rtol=2e-6, atol=1e-4, equal_nan=True)
        assert torch.isfinite(got[i]).sum() == torch.isfinite(want).sum()  # -inf exactly where the reference has it
        top2 = torch.topk(want, min(2, len(want))).values
        if len(top2) < 2 or top2[0] - top2[1] > 1e-3 * max(1.0, abs(top2[0].item())):
            argmax = int(torch.argmax(want))
            greedy = replace(p, temperature=0.0)
            top1 = replace(p, temperature=1.0, top_k=1, seed=5)  # a sampled row that can only take the best
            for sampler in (Sampler(0), Sampler(0, on_device=True)):  # both paths see the adjusted logits
                assert _apply(logits[i : i + 1], [(greedy, prompt, output)], sampler) == [argmax]
                assert _apply(logits[i : i + 1], [(top1, prompt, output)], sampler) == [argmax]


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_a_row_does_not_depend_on_its_batch_on_either_path(case):
    """Bit-identical adjusted logits alone and in the batch; identical greedy and seeded tokens."""
    logits, batch = case
    together = _apply(logits, batch)
    for on_device in (False, True):
        tokens = _apply(logits, batch, Sampler(3, on_device=on_device))
        for i, row in enumerate(batch):
            alone = _apply(logits[i : i + 1], [row])
            assert torch.equal(alone[0], together[i])
            assert _apply(logits[i : i + 1], [row], Sampler(9, on_device=on_device)) == [tokens[i]]


def test_each_rule_by_hand():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5, 2.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [0, 1], output [2, 2, 1]: 0 prompt only, 1 and 2 in the output (2 twice)
    got = apply_penalties(x, [p], [3], [[0, 1, 2, 2, 1]], [2])
    assert got.tolist() == [[0.5, -4.0 - 0.5 - 0.25, 1.5 - 1.0 - 0.25, 0.5, 2.0]]
    p = SamplingParams(logit_bias={"4": 1.5, 0: -100}, min_tokens=2, stop_token_ids=(2, 99), max_tokens=4)
    got = apply_penalties(x, [p], [1])
    assert got.tolist() == [[-99.0, -2.0, -INF, 0.5, 3.5]]


def test_min_tokens_reached_leaves_only_the_bias():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5, 2.0]])
    held = SamplingParams(min_tokens=2, stop_token_ids=(2,), max_tokens=4)
    assert apply_penalties(x, [held], [1])[0, 2] == -INF
    assert apply_penalties(x, [held], [2]) is x
    biased = replace(held, logit_bias={2: 1.0})
    assert apply_penalties(x, [biased], [2]).tolist() == [[1.0, -2.0, 4.0, 0.5, 2.0]]


# --------------------------------------------------------------- fast path
def test_neutral_values_take_the_fast_path():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=gen).bfloat16()
    neutral = [
        SamplingParams(),
        SamplingParams(presence_penalty=0.0, frequency_penalty=-0.0, repetition_penalty=1.0, logit_bias={}),
        SamplingParams(min_tokens=3, max_tokens=5),  # no stop ids to hold back
        SamplingParams(min_tokens=2, stop_token_ids=(1,), max_tokens=5),  # reached (2 outputs)
        SamplingParams(logit_bias=None, temperature=0.8, seed=1),
    ]
    assert not any(adjusts(p, 2) for p in neutral)
    assert apply_penalties(logits, neutral, [2] * 5) is logits  # the same tensor: no copy, no kernel
    for on_device in (False, True):
        assert Sampler(4, on_device=on_device).sample_rows(logits, neutral, [2] * 5) == \
            Sampler(4, on_device=on_device).sample_rows(logits, [SamplingParams(temperature=p.temperature, seed=p.seed)
                                                                 for p in neutral], [2] * 5)
    mixed = neutral + [SamplingParams(presence_penalty=1.0)]
    out = apply_penalties(torch.cat([logits, logits[:1]]), mixed, [2] * 6, [None] * 5 + [[3, 3, 4]], [0] * 5 + [1])
    assert torch.equal(out[:5], logits.float())  # the neutral rows bit-identical beside a penalized one
    assert out[5, 3] == logits[0, 3].float() - 1.0 and out[5, 4] == logits[0, 4].float() - 1.0
    assert torch.equal(out[5, :3], logits[0, :3].float())  # tokens 0-2 are in no history


# ------------------------------------------------------------------ faults
def test_faults_stay_faults_and_no_row_raises():
    vocab = 4
    stops = SamplingParams(min_tokens=1, stop_token_ids=(0, 1, 2, 3), max_tokens=2)
    bias_all = SamplingParams(logit_bias={t: -100.0 for t in range(vocab)})
    logits = torch.tensor([
        [0.0, 1.0, 2.0, 3.0],  # min_tokens holds every token back: nothing above -inf
        [0.5, 1.0, 2.0, 3.0],  # -100 on every token: finite, the same argmax
        [0.0, float("nan"), 2.0, 3.0],  # a nan on a held-back stop id: still a fault
        [0.0, INF, 2.0, 3.0],  # +inf too
        [2.0, 3e38, -3.0, 0.0],  # a repetition penalty that overflows fp32 saturates: no fault
        [-1e10, 1.0, 2.0, 0.0],  # the same below
    ])
    one_stop = SamplingParams(min_tokens=1, stop_token_ids=(1,), max_tokens=2)  # the nan / +inf token only
    params = [stops, bias_all, one_stop, one_stop, SamplingParams(repetition_penalty=1e-30),
              SamplingParams(repetition_penalty=1e30)]
    history = [None, None, None, None, [0, 1, 2, 3], [0, 1, 2]]
    for on_device in (False, True):
        got = Sampler(0, on_device=on_device).sample_rows(logits, params, [0] * 6, history, [4, 4, 4, 4, 4, 3])
        assert got == [FAULT, 3, FAULT, FAULT, 1, 2]  # 2 / 1e30 > 0
    adjusted = apply_penalties(logits, params, [0] * 6, history, [4, 4, 4, 4, 4, 3])
    assert adjusted[0].tolist() == [-INF] * 4 and adjusted[1].tolist() == [-99.5, -99.0, -98.0, -97.0]
    assert adjusted[4, 1] == F32_MAX and adjusted[5, 0] == -F32_MAX and torch.isfinite(adjusted[4:]).all()


# -------------------------------------------------------------- validation
@pytest.mark.parametrize("name, value", [
    ("presence_penalty", 2.0001), ("presence_penalty", -2.5), ("presence_penalty", float("nan")),
    ("presence_penalty", "1"), ("presence_penalty", True), ("presence_penalty", None),
    ("frequency_penalty", -2.0001), ("frequency_penalty", float("inf")), ("frequency_penalty", 10**400),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", float("nan")), ("repetition_penalty", "2"),
    ("logit_bias", {1: 100.5}), ("logit_bias", {1: -101}), ("logit_bias", {1: float("nan")}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"a": 1.0}), ("logit_bias", {"-3": 1.0}), ("logit_bias", {" 3": 1.0}),
    ("logit_bias", {True: 1.0}), ("logit_bias", {1.0: 1.0}), ("logit_bias", {1: "1"}), ("logit_bias", {1: 1, "1": 2}),
    ("logit_bias", "12"), ("logit_bias", 5), ("logit_bias", [(1,)]),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True), ("min_tokens", 17), ("min_tokens", None),
])
def test_bad_values_name_their_param(name, value):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(max_tokens=16, **{name: value})
    assert err.value.param == name


def test_accepted_values_and_their_frozen_form():
    p = SamplingParams(max_tokens=8, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-300,
                       logit_bias={"7": -100, 3: 100, 0: 0}, min_tokens=8)
    assert p.logit_bias == ((0, 0.0), (3, 100.0), (7, -100.0)) and p.presence_penalty == -2.0
    assert isinstance(p.frequency_penalty, float) and p.penalized
    assert p == SamplingParams(max_tokens=8, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-300,
                               logit_bias=[(7, -100.0), (0, 0), (3, 100)], min_tokens=8)
    assert hash(p) == hash(replace(p))
    with pytest.raises(AttributeError):
        p.min_tokens = 1  # type: ignore[misc]
    eos = p.with_eos([5, 9])
    assert eos.stop_token_ids == (5, 9)
    assert (eos.logit_bias, eos.min_tokens, eos.repetition_penalty) == (p.logit_bias, 8, 1e-300)
    assert not SamplingParams(logit_bias=None).penalized and SamplingParams(logit_bias=None).logit_bias == ()


def test_out_of_vocab_bias_ids_are_a_typed_error():
    p = SamplingParams(logit_bias={3: 1.0, 12: 2.0, 40: 1.0})
    p.check_vocab(41)
    with pytest.raises(InvalidArgumentError) as err:
        p.check_vocab(12)
    assert err.value.param == "logit_bias" and "[12, 40]" in str(err.value)
    for on_device in (False, True):
        with pytest.raises(InvalidArgumentError):
            Sampler(0, on_device=on_device).sample_rows(torch.zeros(2, 12), [SamplingParams(), p], [0, 0])


def test_a_penalized_row_needs_its_history():
    p = SamplingParams(frequency_penalty=1.0)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        apply_penalties(torch.zeros(1, 5), [p], [2])
    with pytest.raises(InvalidArgumentError, match="token ids"):
        apply_penalties(torch.zeros(1, 5), [p], [2], [[1, 2]], [1])  # shorter than prompt + output
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        apply_penalties(torch.zeros(1, 5), [p], [1], [[1, 7]], [1])


# ---------------------------------------------------------------- scheduler
def test_the_scheduler_hands_the_live_token_list():
    from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
    from hybridkv.core.kv_cache_manager import KVCacheManager
    from hybridkv.scheduler import Scheduler, SchedulerConfig
    from tests.support.kv_specs import full

    kv = KVCacheManager(KVCacheConfig(32, (KVCacheGroup(full(4)),)), CacheManagerConfig(max_model_len=64))
    s = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64))
    seq = s.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, repetition_penalty=1.5))
    for step in range(3):
        out = s.schedule()
        (r,) = out.scheduled
        assert r.all_token_ids is seq.request.all_token_ids and r.num_prompt_tokens == 3
        assert r.num_output_tokens == step and len(r.all_token_ids) == 3 + step
        s.update_from_output(out, {"a": 40 + step})
    assert r.all_token_ids[:5] == [5, 6, 7, 40, 41]


# ------------------------------------------------------------------ engine
ARCH = "llama"
NEW = 10


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models(ARCH)


def _prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path):
    from hybridkv.engine.engine import EngineConfig, LLMEngine

    return LLMEngine(path, EngineConfig(block_size=8, num_blocks=128, max_model_len=128))


def _hf_generate(hf, prompt, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def test_min_tokens_holds_eos_back_like_hf_min_new_tokens(tiny, tmp_path):
    path, hf = tiny
    prompt = _prompt(1)
    plain = _hf_generate(hf, prompt)
    i = next(i for i in range(1, NEW) if plain[i] not in plain[:i])
    eos = plain[i]  # the model's EOS: its first greedy token after the first that is new
    model_dir = tmp_path / "m"
    shutil.copytree(path, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    engine = _engine(model_dir)
    stopped, held, ignored = engine.generate(
        [prompt] * 3,
        [SamplingParams(max_tokens=NEW), SamplingParams(max_tokens=NEW, min_tokens=i + 3),
         SamplingParams(max_tokens=NEW, min_tokens=i + 3, ignore_eos=True)],
    )
    assert list(stopped.output_token_ids) == plain[: i + 1] and stopped.finish_reason == "stop"
    want = _hf_generate(hf, prompt, eos_token_id=eos, min_new_tokens=i + 3)
    assert list(held.output_token_ids) == want
    assert eos not in want[: i + 3] and len(want) >= i + 3
    assert list(ignored.output_token_ids) == plain  # ignore_eos: EOS is no stop token, nothing held back


def test_greedy_repetition_penalty_equals_hf_generate(tiny):
    path, hf = tiny
    engine = _engine(path)
    prompts = [_prompt(2), _prompt(3, 20), _prompt(4, 7)]
    params = [SamplingParams(max_tokens=NEW, repetition_penalty=1.8), SamplingParams(max_tokens=NEW),
              SamplingParams(max_tokens=NEW, repetition_penalty=0.6)]
    outs = engine.generate(prompts, params)
    changed = 0
    for prompt, p, out in zip(prompts, params, outs):
        want = _hf_generate(hf, prompt, repetition_penalty=p.repetition_penalty)
        assert list(out.output_token_ids) == want
        changed += want != _hf_generate(hf, prompt)
    assert changed == 2  # both penalties changed the greedy output


def _reference_loop(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding over transformers' logits with :func:`reference` applied in fp64."""
    ids = list(prompt)
    for _ in range(p.max_tokens):
        with torch.no_grad():
            row = hf(torch.tensor([ids])).logits[0, -1].double().tolist()
        x = reference(row, p, prompt, ids[len(prompt):])
        ids.append(max(range(len(x)), key=x.__getitem__))
    return ids[len(prompt):]


def test_frequency_presence_and_bias_follow_a_reference_loop_over_hf_logits(tiny):
    path, hf = tiny
    engine = _engine(path)
    prompts = [_prompt(6), _prompt(7), _prompt(9)]
    plain = engine.generate(prompts, SamplingParams(max_tokens=NEW))
    params = [
        SamplingParams(max_tokens=NEW, frequency_penalty=2.0),
        SamplingParams(max_tokens=NEW, presence_penalty=2.0, logit_bias={plain[1].output_token_ids[0]: -100,
                                                                          "17": 3.0}),
        SamplingParams(max_tokens=NEW, frequency_penalty=-1.0, presence_penalty=0.5, repetition_penalty=1.2),
    ]
    outs = engine.generate(prompts, params)
    for prompt, p, out, base in zip(prompts, params, outs, plain):
        want = _reference_loop(hf, prompt, p)
        assert list(out.output_token_ids) == want
        assert want != list(base.output_token_ids)
