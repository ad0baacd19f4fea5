"""Prompt logprobs through the engine vs transformers' log_softmax over the same prompt (fp32 tiny
models, within 1e-4): chunked prefill (chunks of random sizes), a prompt cached by an earlier
request (no prefix hit is taken: every position gets its value), preemption and recompute under a
tight pool (each request's values come once, complete), the top-k alternatives, and the values
computed in slices of rows equal one whole projection."""

from __future__ import annotations

import random

import pytest
from tests.support.tiers import slow_except
import torch

from hybridkv.engine import prompt_logprobs as pl
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.prompt_logprobs import PromptLogprob, chunk_targets
from hybridkv.errors import InvalidArgumentError
from hybridkv.scheduler import SamplingParams

TOL = 1e-4


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[P - 1, vocab]: row p - 1 is the distribution of prompt position p."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _check(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(prompt) and scores[0] is None
    for p in range(1, len(prompt)):
        s = scores[p]
        assert isinstance(s, PromptLogprob) and s.token_id == prompt[p]
        assert abs(s.logprob - ref[p - 1, prompt[p]].item()) < TOL, (p, s.logprob, ref[p - 1, prompt[p]].item())
        assert len(s.top) == k
        value = ref[p - 1, prompt[p]]  # its rank: 1 + the tokens more likely (ties within TOL either way)
        assert 1 + int((ref[p - 1] > value + TOL).sum()) <= s.rank <= 1 + int((ref[p - 1] > value - TOL).sum())
        if k:
            vals, ids = torch.topk(ref[p - 1], k)
            assert [abs(a - b) < TOL for (_, a), b in zip(s.top, vals.tolist())] == [True] * k
            # ids may swap only where two alternatives tie within the tolerance
            for (got, _), want, v in zip(s.top, ids.tolist(), vals.tolist()):
                assert got == want or abs(ref[p - 1, got].item() - v) < TOL


@pytest.mark.parametrize("arch", slow_except(["gemma3", "llama4_dense", "llama"], 0))
@pytest.mark.parametrize("seed", slow_except(range(2), 0))  # the fast tier: gemma3, seed 0
def test_prompt_logprobs_equal_transformers(arch, seed, tiny_models):
    path, hf = tiny_models(arch)
    rng = random.Random(f"{arch}-{seed}")
    shared = [rng.randrange(128) for _ in range(rng.randint(8, 30))]
    prompts = [shared + [rng.randrange(128) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    prompts.append(list(prompts[0]))  # cached by then: still scored in full
    prompts.append([rng.randrange(128)])  # one token: [None]
    budget = rng.choice([5, 8, 16, 64])
    engine = LLMEngine(path, EngineConfig(block_size=4, num_blocks=400, max_num_batched_tokens=budget, max_model_len=128))
    ks = [rng.choice([0, 1, 5, 20]) for _ in prompts]
    outs = engine.generate(prompts[:3], [SamplingParams(max_tokens=3, prompt_logprobs=k) for k in ks[:3]])
    outs += engine.generate(prompts[3:], [SamplingParams(max_tokens=3, prompt_logprobs=k) for k in ks[3:]])
    for out, prompt, k in zip(outs, prompts, ks):
        if len(prompt) == 1:
            assert out.prompt_logprobs == (None,)
            continue
        _check(out, prompt, _hf_logprobs(hf, prompt), k)
    assert outs[3].num_cached_tokens == 0  # it took no hit, though its prompt was cached
    plain = engine.generate([prompts[0]], SamplingParams(max_tokens=3))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still hit
    assert [o.output_token_ids for o in outs[:1]] == [plain.output_token_ids]  # scoring changes no token
    engine.scheduler.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.usable_blocks


def test_preempted_requests_give_their_values_once_and_complete(tiny_models):
    path, hf = tiny_models("gemma3")
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(20, 40))] for _ in range(4)]
    probe = LLMEngine(path, EngineConfig(block_size=4, num_blocks=2000, max_num_batched_tokens=8, max_model_len=128))
    peak = probe.scheduler.peak_blocks(max(map(len, prompts)) + 6)
    engine = LLMEngine(path, EngineConfig(block_size=4, num_blocks=peak + 3, max_num_batched_tokens=8,
                                          max_model_len=128, admission="first_chunk"))
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, prompt_logprobs=2)) for p in prompts]
    seen: dict[str, int] = {}
    outs = {}
    while engine.has_unfinished_requests():
        for d in engine.step_deltas():
            if d.prompt_logprobs is not None:
                seen[d.request_id] = seen.get(d.request_id, 0) + 1
            if d.output is not None:
                outs[d.request_id] = d.output
        engine.scheduler.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert seen == dict.fromkeys(ids, 1)  # once each, however often it was recomputed
    for rid, prompt in zip(ids, prompts):
        _check(outs[rid], prompt, _hf_logprobs(hf, prompt), 2)


def test_slices_equal_one_projection(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 16, generator=gen)
    hidden = torch.randn(37, 16, generator=gen)
    targets = torch.randint(0, 1000, (37,), generator=gen).tolist()
    whole = pl.prompt_logprobs(lambda h: h @ weight.T, hidden, targets, 3, 1000)
    monkeypatch.setattr(pl, "SLICE_ELEMENTS", 5000)  # 5 rows a slice
    assert pl.slice_rows(1000) == 5
    sliced = pl.prompt_logprobs(lambda h: h @ weight.T, hidden, targets, 3, 1000)
    assert [s.token_id for s in sliced] == targets
    for a, b in zip(whole, sliced):
        assert abs(a.logprob - b.logprob) < 1e-5 and [i for i, _ in a.top] == [i for i, _ in b.top]


def test_chunk_targets_cover_every_position_once():
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 40))]
        covered = []
        c = 0
        while c < len(prompt):
            q = rng.randint(1, 9)
            covered += [(c + 1 + i, t) for i, t in enumerate(chunk_targets(prompt, c, q))]
            c += q
        assert covered == [(p, prompt[p]) for p in range(1, len(prompt))]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_prompt_logprobs_values_are_checked(bad):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"


def test_the_text_front_carries_them(tiny_models):
    from hybridkv.engine.llm import LLM

    path, hf = tiny_models("llama")
    llm = LLM(str(path), EngineConfig(block_size=4, num_blocks=200, max_model_len=128))
    prompt = list(range(3, 20))
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    _check(out, prompt, _hf_logprobs(hf, prompt), 1)
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].prompt_logprobs is None
