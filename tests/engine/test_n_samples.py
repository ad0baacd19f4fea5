"""``n`` samples of one prompt compute the prompt once: the samples after the first hit its cached
blocks (only what the hit leaves, at most a block, is computed again per sample), each with its
own seed stream (seed + j) and its own preemption; the pool holds the prompt once. Through the
LLM front on every layout (full, sliding, chunked, linear-attention states), chunked or not."""

from __future__ import annotations

import random

import pytest
from tests.support.tiers import slow_except
import torch

from hybridkv.core.specs import cdiv
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.llm import LLM
from hybridkv.errors import InvalidArgumentError
from hybridkv.scheduler import SamplingParams

B = 4


def _count_prompt_tokens(engine: LLMEngine) -> dict:
    """Wrap the runner: prompt tokens computed per step (the scheduled tokens below each prompt's end)."""
    real = engine.runner.execute
    seen = {"prompt": 0}

    def execute(output, *args):
        for sr in output.scheduled:
            num_prompt = engine.scheduler.sequences[sr.request_id].request.num_prompt_tokens
            seen["prompt"] += max(0, min(num_prompt, sr.num_computed_tokens + len(sr.token_ids)) - sr.num_computed_tokens)
        return real(output, *args)

    engine.runner.execute = execute
    return seen


@pytest.fixture(scope="module")
def state_model(tmp_path_factory):
    from tests.support.qwen3_next_tiny import build_qwen3_next

    path = tmp_path_factory.mktemp("linear_last")
    build_qwen3_next("linear_last", path)
    return path


@pytest.mark.parametrize("arch", slow_except(["gemma3", "llama4_dense", "llama", "qwen3_next"], 0, 3))
@pytest.mark.parametrize("budget", slow_except([16, 40, 256], 0))  # the fast tier: budget 16, gemma3 and qwen3_next
def test_n_samples_compute_the_prompt_once(arch, budget, tiny_models, request):
    # qwen3_next: its prefill chunks end on block boundaries (state checkpoints), so a chunk
    # can leave budget over while the prompt is still being computed
    path = request.getfixturevalue("state_model") if arch == "qwen3_next" else tiny_models(arch)[0]
    n, num_prompt, new = 8, 97, 6
    prompt = torch.randint(0, 128, (num_prompt,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(str(path), EngineConfig(block_size=B, num_blocks=800, max_num_batched_tokens=budget, max_model_len=256))
    seen = _count_prompt_tokens(llm.engine)
    outs = llm.generate([prompt], SamplingParams(n=n, max_tokens=new, temperature=1.0, seed=11, ignore_eos=True))
    assert len(outs) == n
    bs = llm.engine.block_size  # the state model's is raised to hold a state page
    assert seen["prompt"] <= num_prompt + n * bs, seen  # not n * 97
    assert all(o.num_cached_tokens >= (num_prompt - 1) // bs * bs - bs for o in outs[1:])
    # each sample is its seed's: sample j equals a lone request with seed 11 + j
    for j in (0, 3, n - 1):
        alone = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=1.0, seed=11 + j, ignore_eos=True))
        assert alone[0].token_ids == outs[j].token_ids
    assert len({o.token_ids for o in outs}) > 1
    # each group held the prompt once: its blocks for the prompt + n x (its output blocks + 2)
    usage = llm.engine.kv.pool_usage()
    for peak, spec in zip(usage.peak_per_group, (g.spec for g in llm.engine.grouping.groups)):
        bound = min(cdiv(num_prompt, bs), spec.max_num_blocks(256, budget)) + n * (cdiv(new, bs) + 2)
        assert peak <= bound, (spec, peak, bound)
    llm.engine.scheduler.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.usable_blocks


def test_greedy_samples_are_equal_and_a_tight_pool_preempts_them_apart(tiny_models):
    path, _ = tiny_models("gemma3")
    rng = random.Random(2)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(20, 50))] for _ in range(3)]
    roomy = LLM(str(path), EngineConfig(block_size=B, num_blocks=600, max_num_batched_tokens=16, max_model_len=256))
    greedy = roomy.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    probe = LLMEngine(path, EngineConfig(block_size=B, num_blocks=2000, max_num_batched_tokens=16, max_model_len=256))
    peak = probe.scheduler.peak_blocks(58)
    tight = LLM(str(path), EngineConfig(block_size=B, num_blocks=peak + 8, max_num_batched_tokens=16,
                                        max_model_len=256, admission="first_chunk"))
    outs = tight.generate(prompts, SamplingParams(n=4, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == [g.token_ids for g in greedy for _ in range(4)]
    assert tight.engine.scheduler.num_preemptions > 0
    tight.engine.scheduler.check_invariants()
    assert tight.engine.kv.num_free_blocks == tight.engine.kv.usable_blocks


def test_an_engine_request_is_one_sequence(tiny_models):
    path, _ = tiny_models("llama")
    engine = LLMEngine(path, EngineConfig(block_size=B, num_blocks=100, max_model_len=128))
    with pytest.raises(InvalidArgumentError) as e:
        engine.add_request([1, 2, 3], SamplingParams(n=2))
    assert e.value.param == "n" and not engine.has_unfinished_requests()
    for bad in (0, -1, 129, 1.0, True):
        with pytest.raises(InvalidArgumentError):
            SamplingParams(n=bad)
    assert [p.seed for p in SamplingParams(n=3, seed=7).samples()] == [7, 8, 9]
    assert [p.seed for p in SamplingParams(n=2).samples()] == [None, None]
    assert all(p.n == 1 for p in SamplingParams(n=4).samples())
