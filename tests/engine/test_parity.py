"""Parity with HF transformers 5.24 (eager, fp32, CPU) for every supported family.

(a) prompt logits of a single forward over the paged KV vs HF forward, within 1e-4;
(b) greedy generation through PagedModelRunner (driven by SchedulerOutputs from a
    test scheduler with chunked prefill, batching, out-of-window / out-of-chunk
    blocks replaced by the null block, NaN-poisoned free blocks, prefix sharing and
    preemption) vs HF ``generate(do_sample=False)``: identical tokens, per-step
    logits within 1e-4.

Every family, plus (``EXTRA_CONFIGS``) Qwen3 and the language model of transformers'
own multimodal checkpoints (``gemma3_mm``: a config cut down to gemma-3-4b-it's keys;
``llama4_mm``). The scheduling-heavy cases (prefix sharing, preemption, and
test_engine's) exercise the engine rather than the model, so they run on ``CONFIGS``
only; the extra ones get (a), (b) with chunked prefill and one ``LLMEngine.generate`` run.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.engine_driver import Req, run_engine
from tests.support.hf_tiny import CONFIGS, EXTRA_CONFIGS, hf_generate
from tests.support.tiers import slow_except

from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import AttentionType
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.engine.models import load_model
from hybridkv.scheduler import SamplingParams

ENGINE_ARCHS = list(CONFIGS)
ARCHS = ENGINE_ARCHS + list(EXTRA_CONFIGS)
FAST_ARCHS = ("gemma3", "qwen3")  # the fast tier's architectures; the full suite runs every one


def _params(archs: list[str]) -> list:
    return slow_except(archs, *(i for i, a in enumerate(archs) if a in FAST_ARCHS))

TOL = 1e-4
NEW_TOKENS = 16


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1234)
    base = torch.randint(0, 128, (53,), generator=g).tolist()
    return {
        "A": base,  # 53 + 16 tokens: decode crosses chunk boundaries 60 (C=20) and 64 (C=16)
        "B": base[:40] + torch.randint(0, 128, (11,), generator=g).tolist(),  # shares 40 tokens with A
        "C": torch.randint(0, 128, (37,), generator=g).tolist(),
        "D": list(base),  # identical to A
    }


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def arch_refs(tiny_models):
    """arch -> (our model, {prompt name: (HF tokens, HF step logits)})."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            path, hf = tiny_models(arch)
            refs = {k: hf_generate(hf, p, NEW_TOKENS) for k, p in PROMPTS.items() if k != "D"}
            refs["D"] = refs["A"]
            cache[arch] = (load_model(path), refs)
        return cache[arch]

    return get


def _prefill_logits(model, tokens: list[int], block_size: int = 8) -> torch.Tensor:
    """All-position logits of one sequence computed in one step over paged KV."""
    storage = PagedKVStorage([[i] for i in range(model.num_layers)], block_size, 64, model.num_kv_heads, model.head_dim)
    table = list(range(1, 1 + -(-len(tokens) // block_size)))
    meta = AttentionMetadata.build(storage, [0], [len(tokens)], [[table] * model.num_layers])
    with torch.inference_mode():
        ids = torch.tensor(tokens)
        return model.compute_logits(model(ids, meta.positions, meta))


def _check(result, refs, names):
    for name in names:
        want_tokens, want_logits = refs[name]
        assert result.outputs[name] == want_tokens, f"request {name}: tokens differ from HF generate"
        diff = (result.logits[name] - want_logits).abs().max().item()
        assert diff < TOL, f"request {name}: max logit diff {diff:.2e}"


@pytest.mark.parametrize("arch", _params(ARCHS))
def test_prompt_logits_match_hf_forward(arch, tiny_models, arch_refs):
    _, hf = tiny_models(arch)
    model, _ = arch_refs(arch)
    tokens = PROMPTS["A"]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]  # [T, vocab]
    got = _prefill_logits(model, tokens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("arch", _params(ARCHS))
def test_greedy_batched_chunked_prefill(arch, arch_refs):
    """Three requests in every step, prefill in pieces of 7, block 8."""
    model, refs = arch_refs(arch)
    reqs = [Req(k, PROMPTS[k], NEW_TOKENS) for k in "ABC"]
    result = run_engine(model, reqs, block_size=8, num_blocks=256, prefill_chunk=7)
    _check(result, refs, "ABC")
    local = any(k != "full" for k, _ in model.layer_attention_types())
    assert (result.blocks.stats.nulled_blocks > 0) == local


@pytest.mark.parametrize("arch", _params(ENGINE_ARCHS))
def test_greedy_shared_prefixes(arch, arch_refs):
    """Block 4, one layer per group, later requests start from another request's blocks."""
    model, refs = arch_refs(arch)
    reqs = [
        Req("A", PROMPTS["A"], NEW_TOKENS, arrival=0),
        Req("C", PROMPTS["C"], NEW_TOKENS, arrival=2),
        Req("B", PROMPTS["B"], NEW_TOKENS, arrival=6),
        Req("D", PROMPTS["D"], NEW_TOKENS, arrival=11),
    ]
    result = run_engine(model, reqs, block_size=4, num_blocks=512, prefill_chunk=7, prefix_sharing=True, group_size=1)
    _check(result, refs, "ABCD")
    assert result.blocks.stats.shared_tokens >= 40


@pytest.mark.parametrize("arch", _params(ENGINE_ARCHS))
def test_greedy_under_preemption(arch, arch_refs):
    """A pool that holds one request but not three: requests are preempted and recomputed."""
    model, refs = arch_refs(arch)
    peak = 0
    for k in "ABC":  # blocks one request needs at its peak, alone
        alone = run_engine(model, [Req(k, PROMPTS[k], NEW_TOKENS)], block_size=8, num_blocks=256, prefill_chunk=16)
        peak = max(peak, alone.blocks.stats.peak_used_blocks)
    reqs = [Req(k, PROMPTS[k], NEW_TOKENS) for k in "ABC"]
    result = run_engine(model, reqs, block_size=8, num_blocks=peak + 3, prefill_chunk=16)
    assert result.preemptions > 0
    _check(result, refs, "ABC")


@pytest.mark.parametrize("arch", _params([a for a in ARCHS if a != "llama"]))
def test_wrong_window_or_chunk_is_detected(arch, arch_refs, tiny_models):
    """Control: the prompts are long enough that a window / chunk off by one changes the logits."""
    _, hf = tiny_models(arch)
    model, _ = arch_refs(arch)
    tokens = PROMPTS["A"]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    attns = [layer.self_attn for layer in model.model.layers]
    saved = [a.attn_type for a in attns]
    try:
        for a in attns:
            if a.attn_type.kind != "full":
                a.attn_type = AttentionType(a.attn_type.kind, a.attn_type.size + 1)
        got = _prefill_logits(model, tokens)
    finally:
        for a, t in zip(attns, saved):
            a.attn_type = t
    assert (got - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("arch", _params(list(EXTRA_CONFIGS)))
def test_llm_engine_generates_as_hf(arch, tiny_models, arch_refs):
    """``LLMEngine`` (what ``hybridkv generate`` runs) on the checkpoint directory: HF's greedy tokens."""
    path, _ = tiny_models(arch)
    _, refs = arch_refs(arch)
    engine = LLMEngine(path, EngineConfig(block_size=8, num_blocks=64, max_num_batched_tokens=32, max_model_len=128))
    outs = engine.generate([PROMPTS["A"], PROMPTS["C"]], SamplingParams(max_tokens=NEW_TOKENS))
    assert [list(o.output_token_ids) for o in outs] == [refs["A"][0], refs["C"][0]]
