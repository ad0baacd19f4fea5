"""The batched sampler (a GPU's path; forced on a CPU here): greedy, filters, seeds, distribution."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples

from hybridkv.engine.sampling import Sampler
from hybridkv.scheduler import SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])


def test_greedy_and_filters_pick_the_argmax():
    s = Sampler(0, on_device=True)
    rows = LOGITS.repeat(4, 1)
    for seed in range(20):
        params = [SamplingParams(), SamplingParams(temperature=5.0, top_k=1, seed=seed),
                  SamplingParams(temperature=5.0, top_p=0.01, seed=seed),
                  SamplingParams(temperature=5.0, top_k=2, seed=seed)]
        got = s.sample_rows(rows, params, [0, 0, 0, 0])
        assert got[:3] == [1, 1, 1] and got[3] in (1, 3)


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(0, 2**40), st.integers(0, 500), st.integers(0, 5), st.integers(1, 6))
def test_a_seeded_row_does_not_depend_on_its_batch(seed, count, row, others):
    """The same (seed, token index) draws the same token wherever it sits and whatever runs beside it."""
    gen = torch.Generator().manual_seed(seed % 1000)
    vocab = 50
    mine = torch.randn(vocab, generator=gen)
    params = SamplingParams(temperature=1.1, top_k=20, top_p=0.95, seed=seed)
    alone = Sampler(1, on_device=True).sample_rows(mine.unsqueeze(0), [params], [count])[0]
    batch = torch.randn(others + 1, vocab, generator=gen)
    row = row % (others + 1)
    batch[row] = mine
    plist = [SamplingParams(temperature=0.8) if i % 2 else SamplingParams() for i in range(others + 1)]
    plist[row] = params
    counts = [7] * (others + 1)
    counts[row] = count
    assert Sampler(2, on_device=True).sample_rows(batch, plist, counts)[row] == alone


def test_draws_follow_the_filtered_distribution():
    """4,000 unseeded draws at temperature 2 with top-k 3: frequencies within 5 sigma of the
    renormalised softmax over the 3 largest logits, and nothing outside them."""
    n = 4000
    s = Sampler(3, on_device=True)
    params = [SamplingParams(temperature=2.0, top_k=3)] * n
    got = torch.tensor(s.sample_rows(LOGITS.repeat(n, 1), params, [0] * n))
    keep = torch.tensor([1, 3, 2])
    p = torch.softmax(LOGITS[keep] / 2.0, 0)
    for token, prob in zip(keep.tolist(), p.tolist()):
        freq = (got == token).sum().item()
        assert abs(freq - n * prob) < 5 * math.sqrt(n * prob * (1 - prob)), (token, freq, n * prob)
    assert set(got.tolist()) <= set(keep.tolist())


def test_top_p_keeps_what_the_row_by_row_sampler_keeps():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 30, generator=gen)
    for top_p in (0.3, 0.7, 0.95):
        params = [SamplingParams(temperature=0.9, top_p=top_p, seed=s) for s in range(3)]
        seen_batched, seen_rows = set(), set()
        for count in range(200):
            seen_batched.update(enumerate(Sampler(0, on_device=True).sample_rows(logits, params, [count] * 3)))
            seen_rows.update(enumerate(Sampler(0).sample_rows(logits, params, [count] * 3)))
        assert seen_batched <= {(r, t) for r in range(3) for t in _nucleus(logits[r] / 0.9, top_p)}
        assert seen_rows <= {(r, t) for r in range(3) for t in _nucleus(logits[r] / 0.9, top_p)}


def _nucleus(scaled: torch.Tensor, top_p: float) -> set[int]:
    probs = torch.softmax(scaled, 0)
    order = torch.argsort(probs, descending=True).tolist()
    out, mass = set(), 0.0
    for t in order:
        if mass >= top_p:
            break
        out.add(t)
        mass += probs[t].item()
    return out
