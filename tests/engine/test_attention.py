"""Reference paged attention: masks, gathers through block tables, sinks, softcap."""

from __future__ import annotations

import pytest
from tests.support.tiers import slow_except
import torch

from hybridkv.engine.attention.layer import paged_attention
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.types import FULL, AttentionType, allowed_key_mask
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, InvariantViolation

H_Q, H_KV, D = 4, 2, 8


def _cpu_backends() -> list[str]:
    """The backends that run here on a CPU without triton: the reference, and "cpu" where its kernels build."""
    from hybridkv.engine import cpu_ops

    return ["reference"] + (["cpu"] if cpu_ops.load() is not None else [])


CPU_BACKENDS = _cpu_backends()


def test_masks_equal_hf_mask_functions():
    masking = pytest.importorskip("transformers.masking_utils")
    q = torch.arange(90).view(-1, 1)
    k = torch.arange(90).view(1, -1)
    zero = torch.zeros(1, dtype=torch.long)
    for w in (1, 5, 12, 128):
        want = masking.sliding_window_causal_mask_function(w)(0, 0, q, k)
        got = allowed_key_mask(AttentionType("sliding", w), torch.arange(90), torch.arange(90))
        assert torch.equal(got, want)
    for c in (1, 16, 20):
        want = masking.chunked_causal_mask_function(c, zero)(0, 0, q, k)
        got = allowed_key_mask(AttentionType("chunked", c), torch.arange(90), torch.arange(90))
        assert torch.equal(got, want)
    want = masking.causal_mask_function(0, 0, q, k)
    assert torch.equal(allowed_key_mask(FULL, torch.arange(90), torch.arange(90)), want)


def test_mask_conventions_spelled_out():
    sliding = allowed_key_mask(AttentionType("sliding", 4), torch.tensor([10]), torch.arange(12))[0]
    assert sliding.nonzero().flatten().tolist() == [7, 8, 9, 10]  # (p - W, p]
    chunked = allowed_key_mask(AttentionType("chunked", 8), torch.tensor([17]), torch.arange(20))[0]
    assert chunked.nonzero().flatten().tolist() == [16, 17]  # [floor(p/C)*C, p]


def _dense_reference(q, k_all, v_all, positions, attn, scale, sinks=None, softcap=None):
    """q [Tq, Hq, D] at ``positions``; k_all / v_all [L, Hkv, D] for positions 0..L-1."""
    rep = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(rep, dim=1).permute(1, 0, 2)  # [Hq, L, D]
    v = v_all.repeat_interleave(rep, dim=1).permute(1, 0, 2)
    s = torch.einsum("thd,hld->htl", q, k) * scale  # [Hq, Tq, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    mask = allowed_key_mask(attn, positions, torch.arange(k_all.shape[0]))  # [Tq, L]
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(-1, 1, 1).expand(-1, s.shape[1], 1)], dim=-1)
        p = torch.softmax(s, -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("htl,hld->thd", p, v)


def _scenario(attn, block_size, seqs, seed=0, sinks=False, softcap=None, num_blocks=80, outputs=None,
              backend="reference", kv_dtype=torch.float32):
    """seqs: [(num_computed, q_len)]. Builds random KV history, random tables, checks one step.

    outputs: also attend from only these sequences' last tokens (``keep``) and check those rows.
    kv_dtype: the cache's (fp32 queries; the dense reference reads K/V rounded to it, as stored).
    """
    g = torch.Generator().manual_seed(seed)
    # the "cpu" backend's kernel runs without debug checks (with them, each step takes the reference path)
    storage = PagedKVStorage([[0]], block_size, num_blocks, H_KV, D, dtype=kv_dtype, debug=backend != "cpu")
    storage.fill_blocks(list(range(num_blocks)), float("nan"))  # anything not written reads as NaN
    free = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()
    tables, hist = [], []
    for n, q_len in seqs:
        nblk = -(-(n + q_len) // block_size)
        table = [free.pop() for _ in range(nblk)]
        first = int(attn.first_key(torch.tensor(n)))
        # blocks wholly before the first key any query may see -> null block
        table = [0 if (b + 1) * block_size <= first else blk for b, blk in enumerate(table)]
        tables.append(table)
        k = torch.randn(n + q_len, H_KV, D, generator=g)
        v = torch.randn(n + q_len, H_KV, D, generator=g)
        hist.append((k, v))
        pos = torch.arange(first, n)  # the history a query may read; written in an earlier step
        if len(pos):
            tab = torch.tensor(table)
            slots = tab[pos // block_size] * block_size + pos % block_size
            storage.write(0, slots, k[first:n], v[first:n])
    meta = AttentionMetadata.build(
        storage, [n for n, _ in seqs], [q for _, q in seqs], [[t] for t in tables], output_seqs=outputs,
        backend=backend,
    )
    q = torch.randn(sum(q for _, q in seqs), H_Q, D, generator=g)
    new_k = torch.cat([k[n:] for (n, _), (k, _) in zip(seqs, hist)])
    new_v = torch.cat([v[n:] for (n, _), (_, v) in zip(seqs, hist)])
    sink = torch.randn(H_Q, generator=g) if sinks else None
    out = paged_attention(q, new_k, new_v, meta, 0, attn, 0.3, sinks=sink, softcap=softcap)
    if outputs is not None:
        keep = meta.output_rows()
        some = paged_attention(q, new_k, new_v, meta, 0, attn, 0.3, sinks=sink, softcap=softcap, keep=keep)
        torch.testing.assert_close(some, out[keep], atol=1e-5, rtol=1e-5)
    start = 0
    for (n, q_len), (k, v) in zip(seqs, hist):
        pos = torch.arange(n, n + q_len)
        k, v = k.to(kv_dtype).float(), v.to(kv_dtype).float()
        want = _dense_reference(q[start : start + q_len], k, v, pos, attn, 0.3, sink, softcap)
        torch.testing.assert_close(out[start : start + q_len], want, atol=1e-5, rtol=1e-5)
        start += q_len


SEQS = [(0, 13), (21, 1), (37, 6), (5, 1), (58, 9)]


@pytest.mark.parametrize(
    "attn",
    [FULL, AttentionType("sliding", 7), AttentionType("sliding", 16), AttentionType("chunked", 10), AttentionType("chunked", 16)],
    ids=lambda a: f"{a.kind}{a.size or ''}",
)
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_paged_attention_matches_dense(attn, block_size, backend):
    _scenario(attn, block_size, SEQS, backend=backend)  # "cpu": a mixed step, the reference path


# decode steps: one query per sequence (the "cpu" backend's fused kernel)
ONE_QUERY = [(21, 1), (5, 1), (70, 1), (0, 1), (33, 1), (16, 1), (47, 1)]


@pytest.mark.parametrize(
    "attn",
    [FULL, AttentionType("sliding", 1), AttentionType("sliding", 7), AttentionType("sliding", 16),
     AttentionType("chunked", 10), AttentionType("chunked", 16)],
    ids=lambda a: f"{a.kind}{a.size or ''}",
)
@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_decode_steps_match_dense(attn, block_size, backend, monkeypatch):
    from hybridkv.engine import cpu_ops

    calls = []
    kernel = cpu_ops.decode_attention
    monkeypatch.setattr(cpu_ops, "decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for seed in range(3):
        _scenario(attn, block_size, ONE_QUERY[seed:], seed=seed, num_blocks=400, backend=backend)
    assert len(calls) == (3 if backend == "cpu" else 0)  # the fused kernel ran every decode step


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("attn", [FULL, AttentionType("sliding", 7), AttentionType("chunked", 10)],
                         ids=lambda a: f"{a.kind}{a.size or ''}")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_half_cache_under_fp32_queries_matches_dense(attn, backend, kv_dtype, monkeypatch):
    """--kv-cache-dtype: an fp32 model over a bf16 / fp16 cache, in mixed steps (the reference path)
    and decode steps (the cpu backend's C kernel, which writes the new K/V rounded as torch does),
    against the dense fp64 attention over the K/V as stored."""
    from hybridkv.engine import cpu_ops

    calls = []
    kernel = cpu_ops.decode_attention
    monkeypatch.setattr(cpu_ops, "decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    _scenario(attn, 4, SEQS, backend=backend, kv_dtype=kv_dtype)
    for seed in range(2):
        _scenario(attn, [1, 8][seed], ONE_QUERY[seed:], seed=seed, num_blocks=400, backend=backend, kv_dtype=kv_dtype)
    assert len(calls) == (2 if backend == "cpu" else 0)


# long prefills (several chunk / window pieces, history reads, several buckets) next to decodes
LONG = [(0, 70), (0, 21), (33, 40), (5, 1), (64, 1), (0, 3), (90, 2), (17, 16)]


@pytest.mark.parametrize(
    "attn",
    [FULL, AttentionType("sliding", 16), AttentionType("chunked", 16), AttentionType("chunked", 20)],
    ids=lambda a: f"{a.kind}{a.size or ''}",
)
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_many_buckets_match_dense(attn, block_size, backend):
    _scenario(attn, block_size, LONG, seed=5, num_blocks=200, outputs=[6, 0, 3, 7], backend=backend)


def test_sinks_with_long_prefills_match_dense():
    _scenario(AttentionType("sliding", 16), 8, LONG, seed=6, sinks=True, num_blocks=100, outputs=[1, 4])
    _scenario(FULL, 4, LONG, seed=7, softcap=2.0, num_blocks=200)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sinks_and_softcap_match_dense(backend):
    _scenario(AttentionType("sliding", 9), 4, SEQS, seed=3, sinks=True, backend=backend)
    _scenario(FULL, 8, SEQS, seed=4, softcap=2.0, backend=backend)
    # decode steps with sinks or soft-capping: the "cpu" backend leaves them to the reference
    _scenario(AttentionType("sliding", 9), 4, ONE_QUERY, seed=5, sinks=True, num_blocks=200, backend=backend)
    _scenario(FULL, 4, ONE_QUERY, seed=6, softcap=2.0, num_blocks=200, backend=backend)


@pytest.mark.parametrize("backend", slow_except(["reference", "triton", "cpu"], 0, 2))  # the triton interpreter: slow
def test_null_block_in_needed_range_is_an_invariant_violation(backend):
    if backend == "triton":
        pytest.importorskip("triton")
        from hybridkv.engine.attention.triton_kernels import triton_unavailable

        if triton_unavailable("cpu") is not None:
            pytest.skip(triton_unavailable("cpu"))
    storage = PagedKVStorage([[0]], 4, 16, H_KV, D)
    # query at position 10, window 5 needs keys 6..10 -> blocks 1 and 2; block 1 is null here
    meta = AttentionMetadata.build(storage, [10], [1], [[[3, 0, 5]]], backend=backend)
    q = torch.zeros(1, H_Q, D)
    kv = torch.zeros(1, H_KV, D)
    with pytest.raises(InvariantViolation, match="null block"):
        paged_attention(q, kv, kv, meta, 0, AttentionType("sliding", 5), 1.0)
    # the same table is fine for window 3 (keys 8..10, block 2 only)
    meta = AttentionMetadata.build(storage, [10], [1], [[[3, 0, 5]]], backend=backend)
    paged_attention(q, kv, kv, meta, 0, AttentionType("sliding", 3), 1.0)
    # a write to the null block is refused too
    meta = AttentionMetadata.build(storage, [0], [1], [[[0]]], backend=backend)
    with pytest.raises(InvariantViolation, match="write to the null block"):
        paged_attention(q, kv, kv, meta, 0, FULL, 1.0)


def test_metadata_validates_inputs():
    storage = PagedKVStorage([[0], [1]], 4, 16, H_KV, D)
    with pytest.raises(InvalidArgumentError, match="2 KV cache groups"):
        AttentionMetadata.build(storage, [0], [3], [[[1]]])
    with pytest.raises(InvalidArgumentError, match="cannot hold"):
        AttentionMetadata.build(storage, [0], [5], [[[1], [2, 3]]])
    with pytest.raises(InvalidArgumentError, match="at least one"):
        AttentionMetadata.build(storage, [], [], [])
    with pytest.raises(InvalidArgumentError, match="new token"):
        AttentionMetadata.build(storage, [0], [0], [[[1], [2]]])


def test_slot_mapping_and_positions():
    storage = PagedKVStorage([[0], [1]], 4, 16, H_KV, D)
    meta = AttentionMetadata.build(storage, [6, 0], [3, 2], [[[0, 7, 9], [1, 2, 3]], [[4], [5]]])
    assert meta.positions.tolist() == [6, 7, 8, 0, 1]
    assert meta.slot_mappings[0].tolist() == [7 * 4 + 2, 7 * 4 + 3, 9 * 4 + 0, 4 * 4, 4 * 4 + 1]
    assert meta.slot_mappings[1].tolist() == [2 * 4 + 2, 2 * 4 + 3, 3 * 4 + 0, 5 * 4, 5 * 4 + 1]


def test_attention_type_validation():
    with pytest.raises(InvalidConfigError):
        AttentionType("sliding", 0)
    with pytest.raises(InvalidConfigError):
        AttentionType("full", 4)
    with pytest.raises(InvalidConfigError):
        AttentionType("local", 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "attn",
    [FULL, AttentionType("sliding", 16), AttentionType("chunked", 20), AttentionType("sliding", 1)],
    ids=lambda a: f"{a.kind}{a.size or ''}",
)
def test_triton_backend_matches_dense(attn):
    """The same scenarios through the triton backend (interpreter on CPU): prefill + decode
    mixes with the last layer's rows, sinks and soft-cap, and a pure decode step."""
    pytest.importorskip("triton")
    from hybridkv.engine.attention.triton_kernels import triton_unavailable

    if triton_unavailable("cpu") is not None:
        pytest.skip(triton_unavailable("cpu"))
    _scenario(attn, 4, LONG, seed=5, num_blocks=200, outputs=[6, 0, 3, 7], backend="triton")
    _scenario(attn, 8, LONG, seed=6, sinks=True, softcap=2.0, num_blocks=100, outputs=[1, 4], backend="triton")
    _scenario(attn, 4, [(21, 1), (5, 1), (70, 1)], seed=8, sinks=True, num_blocks=100, backend="triton")


# decodes of very different lengths: past DECODE_SPLIT_KEYS the decode bucket is split by key length
DECODES = [(3, 1), (60, 1), (17, 1), (90, 1), (1, 1), (45, 1), (0, 9), (77, 1)]


@pytest.mark.parametrize(
    "attn",
    [FULL, AttentionType("sliding", 16), AttentionType("chunked", 20)],
    ids=lambda a: f"{a.kind}{a.size or ''}",
)
@pytest.mark.parametrize("split_keys", [8192, 40])
def test_decodes_split_by_key_length_match_dense(monkeypatch, attn, split_keys):
    import hybridkv.engine.attention.plan as plan

    monkeypatch.setattr(plan, "DECODE_SPLIT_KEYS", split_keys)
    layout = plan.build_layout(attn.kind, attn.size, [n for n, _ in DECODES], [q for _, q in DECODES], 4,
                               torch.device("cpu"))
    decode_buckets = [b for b in layout.buckets if b.q == 1]
    if split_keys == 8192:
        assert len(decode_buckets) == 1
    elif attn.kind == "full":  # 1..91 keys: one bucket would pad 7 decodes to 91
        assert len(decode_buckets) > 1
    _scenario(attn, 4, DECODES, seed=11, num_blocks=200, outputs=[0, 3, 6])
    _scenario(attn, 4, DECODES, seed=12, num_blocks=200, sinks=True)


def test_scratch_gather_equals_a_fresh_one():
    g = torch.Generator().manual_seed(3)
    storage = PagedKVStorage([[0, 1]], 4, 30, H_KV, D)
    slots = torch.arange(4, 120)
    storage.write(0, slots, torch.randn(116, H_KV, D, generator=g), torch.randn(116, H_KV, D, generator=g))
    storage.write(1, slots, torch.randn(116, H_KV, D, generator=g), torch.randn(116, H_KV, D, generator=g))
    for layer, picked in ((0, slots[:10]), (1, slots.flip(0)), (0, slots[::3])):  # grows, then shrinks
        want = storage.gather(layer, picked)
        got = storage.gather(layer, picked, scratch=True)
        assert got.shape == want.shape == (2 * H_KV, len(picked), D) and torch.equal(got, want)
