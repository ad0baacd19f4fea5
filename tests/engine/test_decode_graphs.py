"""Decode steps over static padded buffers (the CUDA-graph path) and the backend choice.

On a CPU the padded path runs eagerly through triton's interpreter: the same buffers,
padding, metadata and kernels a captured graph replays, only the capture is left out.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.support.hf_tiny import hf_generate

from hybridkv.engine.attention.decode_graphs import capture_sizes
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.attention.registry import resolve_backend
from hybridkv.engine.attention.triton_kernels import triton_unavailable
from hybridkv.errors import InvalidConfigError
from hybridkv.scheduler import SamplingParams

needs_triton = pytest.mark.skipif(
    triton_unavailable("cpu") is not None, reason=str(triton_unavailable("cpu"))
)


@given(st.integers(1, 600))
def test_capture_sizes(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] >= max_num_seqs and (len(sizes) == 1 or sizes[-2] < max_num_seqs)
    assert all(s in (1, 2, 4) or s % 8 == 0 for s in sizes)
    assert sizes[-1] - max_num_seqs < 8  # at most 7 padded rows


def test_capture_sizes_examples():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def test_backend_choice(monkeypatch):
    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("reference", "cuda") == "reference"
    with pytest.raises(InvalidConfigError, match="attention_backend must be one of auto, reference, triton"):
        resolve_backend("flash", "cpu")
    with pytest.raises(InvalidConfigError, match="attention_backend must be one of"):
        EngineConfig(attention_backend=["triton"])
    with pytest.raises(InvalidConfigError, match="enforce_eager must be a bool"):
        EngineConfig(enforce_eager="yes")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter cannot run the kernels
    with pytest.raises(InvalidConfigError, match="'triton' cannot run here: triton kernels need a CUDA device"):
        resolve_backend("triton", "cpu")


def test_triton_refused_before_the_model_loads(monkeypatch, tiny_models):
    path, _ = tiny_models("llama")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidConfigError, match="cannot run here"):
        LLMEngine(path / "does-not-exist", EngineConfig(attention_backend="triton"))


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "llama4_dense"])
def test_padded_decode_path_matches_hf(arch, tiny_models):
    """5 requests, max_num_seqs 6 (sizes 1, 2, 4, 8): batches of 5 down to 1 run padded; greedy
    tokens and logits as HF's; padded rows write nothing (the pool's free blocks stay NaN)."""
    path, hf = tiny_models(arch)
    prompts = _prompts(5, seed=3)
    max_tokens = [9, 4, 12, 6, 2]
    want = [hf_generate(hf, p, n) for p, n in zip(prompts, max_tokens)]
    engine = LLMEngine(path, EngineConfig(block_size=4, num_blocks=120, max_model_len=64, max_num_seqs=6,
                                          attention_backend="triton", max_num_batched_tokens=48))
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and not graphs.capture
    engine.storage.fill_blocks(list(range(engine.storage.num_blocks)), float("nan"))
    runs, logits = [], {}
    real_run = graphs.run

    def counting_run(tokens, computed, tables):
        runs.append(len(tokens))
        return real_run(tokens, computed, tables)

    graphs.run = counting_run
    for p, n in zip(prompts, max_tokens):
        engine.add_request(p, SamplingParams(max_tokens=n))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        for rid, row in engine.last_logits.items():
            logits.setdefault(rid, []).append(row)
        engine.scheduler.check_invariants()
    assert sorted(set(runs)) == [1, 2, 3, 4, 5]  # every batch size down to 1 took the padded path
    for i, (tokens, ref_logits) in enumerate(want):
        assert list(outputs[f"req-{i}"].output_token_ids) == tokens
        diff = (torch.stack(logits[f"req-{i}"]) - ref_logits).abs().max().item()
        assert diff < 1e-4
    assert torch.isnan(engine.storage.kv_caches[0][:, :, 0]).all()  # the null block: never written


@needs_triton
def test_enforce_eager_and_moe_models_have_no_graphs(tiny_models):
    moe, _ = tiny_models("gpt_oss")  # picks its experts on the host: not capturable
    assert LLMEngine(moe, EngineConfig(num_blocks=64, attention_backend="triton")).decode_graphs is None
    path, _ = tiny_models("llama")
    assert LLMEngine(path, EngineConfig(num_blocks=64, attention_backend="triton", enforce_eager=True)).decode_graphs is None
    assert LLMEngine(path, EngineConfig(num_blocks=64)).decode_graphs is None  # auto on a CPU: reference
