"""Seeds are ints in [0, 2**64) (vLLM's range), refused outside it (never wrapped), and every seed
in the range draws its own stream: a seed and the same seed + 2**63 (equal modulo the sampler's
63-bit arithmetic) differ; n samples take ``(seed + i) mod 2**64``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.errors import InvalidArgumentError
from hybridkv.sampling_params import SEED_LIMIT, SamplingParams

from tests.support.tiers import examples

torch = pytest.importorskip("torch")

from hybridkv.engine.sampling import step_seed  # noqa: E402


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(-(2**70), 2**70))
def test_seed_range_is_enforced(seed):
    if 0 <= seed < SEED_LIMIT:
        assert SamplingParams(seed=seed).seed == seed
    else:
        with pytest.raises(InvalidArgumentError) as err:
            SamplingParams(seed=seed)
        assert err.value.param == "seed"


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(0, 4096))
def test_the_top_bit_draws_another_stream(seed, step):
    low, high = step_seed(seed, step), step_seed(seed + 2**63, step)
    assert low != high and 0 <= low < 2**63 and 0 <= high < 2**63


def test_n_samples_wrap_at_the_limit():
    samples = SamplingParams(seed=SEED_LIMIT - 2, n=4, temperature=1.0).samples()
    assert [s.seed for s in samples] == [SEED_LIMIT - 2, SEED_LIMIT - 1, 0, 1]


def test_seeds_past_the_range_are_400s_naming_seed(tiny_llm):
    from tests.support.tiny_server import run_app

    async def body(client, front, app):
        out = {}
        for seed in (2**64, -1, 2**64 - 1, 2**63):
            r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 1.0,
                                                           "seed": seed})
            out[seed] = (r.status_code, r.json())
        return out

    out, blocks = run_app(tiny_llm, body)
    for seed in (2**64, -1):
        assert out[seed][0] == 400 and out[seed][1]["error"]["param"] == "seed"
    assert out[2**64 - 1][0] == out[2**63][0] == 200
    assert blocks[0] == blocks[1]
