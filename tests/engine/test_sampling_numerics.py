"""The sampler is defined for every value SamplingParams accepts, on both paths (row by row on
the CPU, batched where the logits are): never an exception, the argmax wherever the filters
leave one candidate, else a token of the kept set; a row of nan / +inf / all -inf logits is a
model fault (FAULT) and changes nothing for the other rows."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples

from hybridkv.engine.sampling import FAULT, Sampler, filtered_probs
from hybridkv.sampling_params import GREEDY_BELOW, SamplingParams

TINY = 5e-324  # the smallest subnormal double
EXTREME_TEMPS = [0.0, TINY, 1e-300, 1e-38, 1e-12, GREEDY_BELOW * 0.999, GREEDY_BELOW, 1e-3, 1.0, 7.5, 1e30,
                 3.5e38, sys.float_info.max]
EXTREME_TOP_P = [TINY, 1e-300, 1e-38, 1e-9, 0.3, 0.999999, 1.0]
EXTREME_TOP_K = [0, 1, 2, 3, 50, 2**31, 2**62]

temps = st.one_of(st.sampled_from(EXTREME_TEMPS), st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False))
top_ps = st.one_of(st.sampled_from(EXTREME_TOP_P), st.floats(TINY, 1.0, exclude_min=False))
top_ks = st.one_of(st.sampled_from(EXTREME_TOP_K), st.integers(0, 100))
params = st.builds(SamplingParams, temperature=temps, top_k=top_ks, top_p=top_ps,
                   seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))  # SEED_LIMIT


def _row(draw, vocab: int) -> torch.Tensor:
    kind = draw(st.sampled_from(["normal", "equal", "one_finite", "huge", "spread", "nan", "posinf", "all_neginf",
                                 "some_neginf"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(vocab, generator=gen, dtype=torch.float64)
    if kind == "equal":
        x = torch.full((vocab,), draw(st.sampled_from([0.0, -1e30, 3e38, -3e38, 1.0])), dtype=torch.float64)
    elif kind == "one_finite":
        x = torch.full((vocab,), -math.inf, dtype=torch.float64)
        x[draw(st.integers(0, vocab - 1))] = draw(st.sampled_from([0.0, -3e38, 3e38, 5.0]))
    elif kind == "huge":
        x = x * 1e37
    elif kind == "spread":
        x = x * 1e4
    elif kind == "some_neginf":
        x[torch.rand(vocab, generator=gen) < 0.5] = -math.inf
        x[draw(st.integers(0, vocab - 1))] = 1.0
    elif kind in ("nan", "posinf"):
        x[draw(st.integers(0, vocab - 1))] = math.nan if kind == "nan" else math.inf
    elif kind == "all_neginf":
        x = torch.full((vocab,), -math.inf, dtype=torch.float64)
    return x


@st.composite
def batches(draw, max_vocab: int = 64):
    vocab = draw(st.integers(1, max_vocab))
    n = draw(st.integers(1, 6))
    rows = torch.stack([_row(draw, vocab) for _ in range(n)])
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    ps = [draw(params) for _ in range(n)]
    counts = [draw(st.integers(0, 10**6)) for _ in range(n)]
    return rows, rows.to(dtype), ps, counts


def _check(rows64: torch.Tensor, logits: torch.Tensor, ps, got) -> None:
    """Each row's token against the filters, computed here in fp64 on the logits as sampled."""
    x = logits.double()
    for row, (p, token) in enumerate(zip(ps, got)):
        r = x[row]
        if torch.isnan(r).any() or torch.isposinf(r).any() or torch.isneginf(r).all():
            assert token == FAULT, (row, token)
            continue
        assert 0 <= token < r.shape[0], (row, token)
        best = int(torch.argmax(r))
        assert math.isfinite(float(r[token])), (row, token)
        finite = int(torch.isfinite(r).sum())
        if p.greedy or p.top_k == 1 or finite == 1:
            if float(r[token]) != float(r[best]):
                raise AssertionError(f"row {row}: {token} is not an argmax ({best}) with one candidate left")
            if p.greedy:
                assert token == best  # argmax's first occurrence, as torch.argmax
            continue
        if 0 < p.top_k < r.shape[0]:
            kth = torch.topk(r, p.top_k).values[-1]
            assert r[token] >= kth, (row, token, "outside top-k")
        if p.top_p < 1.0:
            t = min(p.temperature, 3.4028234663852886e38)
            probs = torch.softmax((r - r.max()) / t, 0)
            above = float(probs[probs > probs[token]].sum())  # mass strictly more likely than the token
            assert above < p.top_p + 1e-4 or above == 0.0, (row, token, above, p.top_p)


@settings(max_examples=examples(300), deadline=None)
@given(batches(), st.booleans(), st.integers(0, 2**31))
def test_every_accepted_value_samples_or_reports_a_fault(batch, on_device, seed):
    rows64, logits, ps, counts = batch
    got = Sampler(seed, on_device=on_device).sample_rows(logits, ps, counts)
    assert len(got) == len(ps) and all(isinstance(t, int) for t in got)
    _check(rows64, logits, ps, got)


@settings(max_examples=examples(60), deadline=None)
@given(batches(max_vocab=12), st.integers(0, 5))
def test_a_fault_row_changes_no_other_row(batch, where):
    """A seeded row draws the same token beside a nan row as alone (both paths)."""
    _, logits, ps, counts = batch
    ps = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=7 + i)
          for i, p in enumerate(ps)]
    for on_device in (False, True):
        alone = Sampler(1, on_device=on_device).sample_rows(logits, ps, counts)
        bad = torch.full((1, logits.shape[1]), float("nan"), dtype=logits.dtype)
        at = where % (len(ps) + 1)
        mixed = torch.cat([logits[:at], bad, logits[at:]])
        got = Sampler(1, on_device=on_device).sample_rows(mixed, ps[:at] + [SamplingParams()] + ps[at:],
                                                         counts[:at] + [0] + counts[at:])
        assert got[at] == FAULT
        assert got[:at] + got[at + 1:] == alone


@pytest.mark.parametrize("on_device", [False, True])
def test_a_huge_vocabulary_at_the_extremes(on_device):
    """Gemma's 262,144 logits in bf16, with temperatures and top-p at the ends of their ranges."""
    vocab = 262_144
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, vocab, generator=gen) * 8).to(torch.bfloat16)
    logits[2] = -math.inf
    logits[2, 12345] = 0.0
    ps = [SamplingParams(temperature=1e-300, seed=1), SamplingParams(temperature=sys.float_info.max, top_p=TINY),
          SamplingParams(temperature=3.0, top_k=2**40, top_p=0.5), SamplingParams(temperature=1e-4, top_p=1e-38)]
    got = Sampler(0, on_device=on_device).sample_rows(logits, ps, [0, 1, 2, 3])
    best = torch.argmax(logits.float(), dim=-1).tolist()
    assert got[0] == best[0] and got[1] == best[1] and got[2] == 12345 and got[3] == best[3]


def test_tiny_temperatures_are_greedy_and_the_floor_is_vllms():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=TINY).greedy
    assert SamplingParams(temperature=GREEDY_BELOW * 0.5).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    assert GREEDY_BELOW == 1e-5


def test_filtered_probs_keep_the_best_token_and_stay_finite():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3e38, -3e38, 0.0], [-math.inf, -math.inf, 5.0]])
    ps = [SamplingParams(temperature=1e-5, top_p=TINY), SamplingParams(temperature=1e-5),
          SamplingParams(temperature=sys.float_info.max)]
    probs = filtered_probs(logits, ps)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert probs.argmax(-1).tolist() == [2, 0, 2]
    assert torch.allclose(probs.sum(-1), torch.ones(3))
