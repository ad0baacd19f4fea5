"""Cascade attention: when a step attends to its shared prefix once, and that it changes nothing.

The rules (:mod:`hybridkv.engine.attention.cascade`) against brute force and worked cases; the triton
backend with cascade against a dense reference on tables that share their first blocks
(full, and sliding / chunked layers whose queries all see the whole prefix); the engine
with cascade (thresholds lowered) against HF greedy generation.
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.support.dense_attention import dense
from tests.support.hf_tiny import hf_generate
from tests.support.tiers import slow_except
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.engine.attention import cascade
from hybridkv.engine.attention.layer import paged_attention
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import FULL, AttentionType
from hybridkv.engine.attention.cascade import cascade_prefix_len, common_prefix_blocks, use_cascade
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.attention.triton_kernels import triton_unavailable
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.scheduler import SamplingParams

needs_triton = pytest.mark.skipif(triton_unavailable("cpu") is not None, reason=str(triton_unavailable("cpu")))


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=5))
def test_common_prefix_blocks_is_brute_force(tables):
    want = 0
    while (want < min(len(t) for t in tables) and tables[0][want] != 0
           and all(t[want] == tables[0][want] for t in tables)):
        want += 1
    assert common_prefix_blocks(tables) == want


def test_cascade_rules():
    shared = [[5, 9, 2, 7] * 8 + [s + 100] for s in range(8)]  # 32 shared blocks of 16: 512 tokens
    args = dict(block_size=16, num_heads=8, num_kv_heads=8, num_sms=132)
    starts, q_lens = [520] * 8, [1] * 8
    assert cascade_prefix_len(shared, starts, q_lens, kind="full", size=None, **args) == 512
    assert cascade_prefix_len(shared, [300] + starts[1:], q_lens, kind="full", size=None, **args) == 300
    assert cascade_prefix_len(shared[:7], starts[:7], q_lens[:7], kind="full", size=None, **args) == 0  # 7 seqs
    assert cascade_prefix_len(shared, [200] * 8, q_lens, kind="full", size=None, **args) == 0  # < 256 tokens
    # a window / chunk that every query sees whole: the last position (520) must be < W / in chunk 0
    assert cascade_prefix_len(shared, starts, q_lens, kind="sliding", size=521, **args) == 512
    assert cascade_prefix_len(shared, starts, q_lens, kind="sliding", size=520, **args) == 0
    assert cascade_prefix_len(shared, starts, q_lens, kind="chunked", size=8192, **args) == 512
    assert cascade_prefix_len(shared, starts, q_lens, kind="chunked", size=512, **args) == 0


def test_use_cascade_is_vllms_model():
    assert use_cascade(512, [1] * 8, 8, 8, 132)  # MHA decode: no flash-decoding to compare with
    assert use_cascade(512, [5] * 8, 32, 8, 132)  # prefill chunks: cascade
    # GQA decode: cascade's waves (32 heads x 1 tile of 128 rows) vs flash-decoding's programs
    assert not use_cascade(4096, [1] * 8, 32, 8, 132)  # 8 x 8 x 32 tiles in 2 waves < 32
    assert use_cascade(4096, [1] * 128, 32, 8, 132)  # 128 x 8 x 32 tiles: 249 waves > 32


def _shared_case(seed, kind, size, page, prefix_blocks, seqs, hq=4, hkv=2, d=16):
    """Sequences whose tables start with the same ``prefix_blocks`` blocks (their keys shared)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = prefix_blocks + sum(-(-(n + q) // page) for n, q in seqs) + 2
    storage = PagedKVStorage([[0]], page, num_blocks, hkv, d)
    storage.fill_blocks(list(range(num_blocks)), float("nan"))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(prefix_blocks)]
    plen = prefix_blocks * page
    shared_k = torch.randn(plen, hkv, d, generator=gen)
    shared_v = torch.randn(plen, hkv, d, generator=gen)
    tables, hist = [], []
    for n, q in seqs:
        table = shared + [free.pop() for _ in range(-(-(n + q) // page) - prefix_blocks)]
        k = torch.cat([shared_k, torch.randn(n + q - plen, hkv, d, generator=gen)])
        v = torch.cat([shared_v, torch.randn(n + q - plen, hkv, d, generator=gen)])
        pos = torch.arange(0, n)
        slots = torch.tensor(table)[pos // page] * page + pos % page
        storage.write(0, slots, k[:n], v[:n])
        tables.append(table)
        hist.append((k, v))
    return storage, tables, hist


@needs_triton
@pytest.mark.parametrize("kind,size", slow_except([("full", None), ("sliding", 64), ("chunked", 64)], 1, multi=True))
def test_cascade_matches_dense(monkeypatch, kind, size):
    monkeypatch.setattr(cascade, "CASCADE_MIN_PREFIX", 8)
    monkeypatch.setattr(cascade, "CASCADE_MIN_SEQS", 2)
    seqs = [(24, 1), (30, 5), (41, 1), (26, 9)]  # 6 shared blocks of 4 = 24 tokens; prefill and decode
    storage, tables, hist = _shared_case(3, kind, size, 4, 6, seqs)
    attn = AttentionType(kind, size) if kind != "full" else FULL
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(n for _, n in seqs), 4, 16, generator=gen)
    new_k = torch.cat([k[n:] for (n, _), (k, _) in zip(seqs, hist)])
    new_v = torch.cat([v[n:] for (n, _), (_, v) in zip(seqs, hist)])
    sinks = torch.randn(4, generator=gen)
    calls = []
    real = cascade.cascade_prefix_len
    monkeypatch.setattr("hybridkv.engine.attention.triton_forward.cascade_prefix_len",
                        lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    for outputs in (None, [3, 0]):
        meta = AttentionMetadata.build(storage, [n for n, _ in seqs], [n for _, n in seqs], [[t] for t in tables],
                                       output_seqs=outputs, backend="triton")
        keep = meta.output_rows()
        out = paged_attention(q, new_k, new_v, meta, 0, attn, 0.4, sinks=sinks, softcap=3.0, keep=keep)
        assert not torch.isnan(out).any()
        start, rows = 0, []
        for (n, nq), (k, v) in zip(seqs, hist):
            rows.append(dense(q[start : start + nq], k, v, torch.arange(n, n + nq), kind, size, 0.4, sinks, 3.0))
            start += nq
        want = torch.cat(rows) if outputs is None else torch.cat([rows[s][-1:] for s in outputs])
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    assert calls == [24, 24]  # the whole shared prefix went through the prefix pass


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_engine_with_cascade_matches_hf(monkeypatch, arch, tiny_models):
    """A system prompt of 40 tokens cached by the first request, three more hit it and decode
    beside it: with the thresholds lowered, their full-attention layers run cascade."""
    monkeypatch.setattr(cascade, "CASCADE_MIN_PREFIX", 16)
    monkeypatch.setattr(cascade, "CASCADE_MIN_SEQS", 3)
    runs = []
    real = cascade.cascade_prefix_len
    monkeypatch.setattr("hybridkv.engine.attention.triton_forward.cascade_prefix_len",
                        lambda *a, **k: runs.append(real(*a, **k)) or runs[-1])
    path, hf = tiny_models(arch)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 128, (40,), generator=g).tolist()
    prompts = [system + torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 7, 1, 12)]
    want = [hf_generate(hf, p, 8)[0] for p in prompts]
    engine = LLMEngine(path, EngineConfig(block_size=8, num_blocks=120, max_model_len=128, attention_backend="triton",
                                          enforce_eager=True, max_num_batched_tokens=64))
    engine.add_request(prompts[0], SamplingParams(max_tokens=8), request_id="r0")
    outputs = {o.request_id: o for o in engine.step()}  # r0's prompt: cached now
    for i in (1, 2, 3):
        engine.add_request(prompts[i], SamplingParams(max_tokens=8), request_id=f"r{i}")
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        engine.scheduler.check_invariants()
    for i, tokens in enumerate(want):
        assert list(outputs[f"r{i}"].output_token_ids) == tokens
    assert max(runs) == 40  # the shared blocks (5 of 8) ran as a prefix pass
