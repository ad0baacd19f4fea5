"""The Triton kernels (KV write, paged attention, split decode) against a dense reference,
on random block tables: windows and chunks 1..33, blocks 1..16, prefix hits, chunked
prefill, sinks, soft-cap, GQA; every slot nobody wrote (the null block, freed blocks,
table padding) holds NaN, so a read of one shows in the output.

On a CPU they run in triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from hybridkv.engine.attention.triton_kernels import triton_unavailable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and triton_unavailable("cuda") is None else "cpu"
if triton_unavailable(DEVICE) is not None:
    pytest.skip(triton_unavailable(DEVICE), allow_module_level=True)

from tests.support.dense_attention import dense, first_key  # noqa: E402
from tests.support.tiers import slow_except  # noqa: E402

from hybridkv.engine.attention.triton_kernels.kv_write import write_kv  # noqa: E402
from hybridkv.engine.attention.triton_kernels.paged_attention import (  # noqa: E402
    block_q_for,
    decode_splits,
    paged_attention_fwd,
    query_blocks,
)


def make_case(rng, kind, size, page, seqs, hq, hkv, d, dtype, num_blocks):
    """Caches filled with NaN; each sequence's visible history written through its table."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.full((hkv, num_blocks, page, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, hist, width = [], [], max(-(-(n + q) // page) for n, q in seqs) + rng.randrange(3)
    for n, q in seqs:
        need = -(-(n + q) // page)
        first = first_key(kind, size, n)  # the first key the step's first query may see
        table = [0 if (b + 1) * page <= first else free.pop() for b in range(need)]
        tables.append(table + [0] * (width - need))  # padding: the null block
        k = torch.randn(n + q, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n + q, hkv, d, generator=gen).to(dtype)
        hist.append((k, v))
        for p in range(first, n):  # history: written in earlier steps
            blk, off = table[p // page], p % page
            k_cache[:, blk, off] = k[p]
            v_cache[:, blk, off] = v[p]
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int64), hist


def run_step(seed, kind, size, page, seqs, hq=4, hkv=2, d=16, dtype=torch.float32, sinks=False,
             softcap=None, num_splits=None, outputs_only=False, query_dtype=None, tail_only=False):
    """``dtype``: the cache's (and by default the query's; ``query_dtype``: an fp32 model over a
    bf16 / fp16 cache, ``--kv-cache-dtype``). ``tail_only``: each sequence's gap (the blocks of
    its own new tokens no later token reads, the core's rule) maps to the NaN null block and its
    tokens get slot -1; the kernel reads the step's keys from its K / V (two sources)."""
    rng = random.Random(seed)
    num_blocks = sum(-(-(n + q) // page) for n, q in seqs) + 3
    k_cache, v_cache, table, hist = make_case(rng, kind, size, page, seqs, hq, hkv, d, dtype, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    starts = [n for n, _ in seqs]
    q_lens = [q for _, q in seqs]
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, hq, d, generator=gen).to(query_dtype or dtype)
    sink = torch.randn(hq, generator=gen) * 2 if sinks else None
    scale = 0.7 / d**0.5
    gaps = 0
    if tail_only:
        for s, (n, q) in enumerate(seqs):
            lo, hi = -(-n // page), min(_dead_before(kind, size, n + q) // page, (n + q - 1) // page)
            table[s, lo:max(lo, hi)] = 0
            gaps += max(0, hi - lo)
    # this step's K/V: one write of all T tokens (a gap's: slot -1, not stored)
    slots = [table[s, p // page].item() * page + p % page if table[s, p // page] else -1
             for s, (n, q) in enumerate(seqs) for p in range(n, n + q)]
    new_k = torch.cat([k[n:] for (n, _), (k, _) in zip(seqs, hist)])
    new_v = torch.cat([v[n:] for (n, _), (_, v) in zip(seqs, hist)])
    write_kv(new_k.to(DEVICE), new_v.to(DEVICE), *(t for t in (k_cache, v_cache)), torch.tensor(slots))
    seq_lens = torch.tensor([n + q for n, q in seqs])
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    if outputs_only:  # one query per sequence: its last token (the last layer's rows)
        ends = [n + q - 1 for n, q in seqs]
        rows = torch.tensor([sum(q_lens[: s + 1]) - 1 for s in range(len(seqs))])
        plan = query_blocks(ends, [1] * len(seqs), block_q_for(hq // hkv, False))
        q_in = query[rows]
    else:
        plan = query_blocks(starts, q_lens, block_q_for(hq // hkv, False))
        q_in = query
    new_kv = None
    if tail_only:
        rows0 = [sum(q_lens[:s]) for s in range(len(seqs))]
        new_kv = tuple(dev(t) for t in (new_k, new_v, torch.tensor(starts), torch.tensor(rows0)))
    if num_splits is not None:  # decode kernel: every sequence computes one token
        assert all(q == 1 for q in q_lens)
        out = paged_attention_fwd(dev(q_in), dev(k_cache), dev(v_cache), dev(table), dev(seq_lens), kind, size,
                                  scale, sinks=sink, softcap=softcap, num_splits=num_splits)
    else:
        plan_t = torch.tensor(plan, dtype=torch.int64).view(-1, 4)
        out = paged_attention_fwd(dev(q_in), dev(k_cache), dev(v_cache), dev(table), dev(seq_lens), kind, size,
                                  scale, plan=dev(plan_t), sinks=sink, softcap=softcap, new_kv=new_kv)
    out = out.cpu()
    assert not torch.isnan(out).any(), "read a slot nobody wrote"
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for s, ((n, q), (k, v)) in enumerate(zip(seqs, hist)):
        pos = torch.arange(n, n + q)
        want = dense(query[start : start + q], k, v, pos, kind, size, scale, sink, softcap)
        got = out[s : s + 1] if outputs_only else out[start : start + q]
        if outputs_only:
            want = want[-1:]
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        start += q
    # the write went exactly to the slots: each new key is where its table says
    flat = k_cache.view(hkv, -1, d)
    stored = torch.tensor(slots) >= 0
    torch.testing.assert_close(flat[:, torch.tensor(slots)[stored]].permute(1, 0, 2), new_k[stored])
    assert torch.isnan(k_cache[:, 0]).all()  # the null block: never written
    return gaps


def _dead_before(kind, size, e):
    """Tokens no query from position e on reads (the core's num_skipped_tokens)."""
    if kind == "sliding":
        return max(0, e - size + 1)
    return e // size * size if kind == "chunked" else 0


KINDS = [("full", None), ("sliding", 1), ("sliding", 7), ("sliding", 16), ("chunked", 1), ("chunked", 10),
         ("chunked", 16), ("chunked", 33), ("sliding", 33)]


@pytest.mark.parametrize("kind,size", slow_except(KINDS, 2, multi=True), ids=lambda x: str(x))
def test_prefill_and_decode_mix(kind, size):
    # a fresh prefill, prefix hits, a chunked-prefill continuation, decodes
    run_step(1, kind, size, 4, [(0, 13), (21, 1), (37, 6), (5, 1), (40, 19)])


@pytest.mark.parametrize("seed", slow_except(range(12), 0))
def test_random_steps(seed):
    rng = random.Random(1000 + seed)
    kind = rng.choice(["full", "sliding", "chunked"])
    size = None if kind == "full" else rng.randint(1, 33)
    page = rng.randint(1, 16)
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 3, 4])
    d = rng.choice([8, 16, 24, 32])
    seqs = [(rng.choice([0, rng.randint(0, 60)]), rng.choice([1, 1, rng.randint(1, 40)])) for _ in range(rng.randint(1, 4))]
    run_step(seed, kind, size, page, seqs, hq=hq, hkv=hkv, d=d, sinks=rng.random() < 0.3,
             softcap=rng.choice([None, None, 1.5]), outputs_only=rng.random() < 0.25)


@pytest.mark.parametrize("seed", slow_except(range(10), 0, 1))
def test_two_sources_for_unstored_gaps(seed):
    """tail_only: chunks longer than a window / chunk leave whole blocks unstored (NaN, slot -1);
    attention reads them from the step's K / V and equals the dense reference."""
    rng = random.Random(2000 + seed)
    kind = ["sliding", "chunked"][seed % 2]
    size, page = rng.randint(1, 12), rng.randint(1, 6)
    seqs = [(rng.choice([0, rng.randint(0, 40)]), rng.randint(1, 50)) for _ in range(rng.randint(1, 3))] + [(9, 1)]
    gaps = run_step(seed, kind, size, page, seqs, hq=2, hkv=1, d=16, sinks=seed % 3 == 0,
                    softcap=[None, 1.5][seed % 2], outputs_only=seed % 4 == 1, tail_only=True)
    assert gaps > 0 or all(q <= size + page for _, q in seqs)


@pytest.mark.parametrize("kind,size", slow_except([("full", None), ("sliding", 5), ("chunked", 12)], 1, multi=True))
@pytest.mark.parametrize("splits", slow_except([1, 3, 4], 1))  # the fast tier: 3 splits, sliding 5
def test_split_decode(kind, size, splits):
    run_step(7, kind, size, 4, [(70, 1), (3, 1), (0, 1), (45, 1)], hq=6, hkv=2, sinks=splits == 3,
             softcap=2.0 if splits == 4 else None, num_splits=splits)


def test_split_decode_padded_rows_are_zero():
    """A padded row (seq_len 0: a CUDA-graph batch's spare row) reads and writes nothing but zeros."""
    hkv, d = 1, 16
    k_cache = torch.full((hkv, 4, 4, d), float("nan"))
    table = torch.zeros(2, 3, dtype=torch.int64)
    out = paged_attention_fwd(torch.randn(2, 2, d), k_cache, k_cache.clone(), table, torch.tensor([0, 0]),
                              "full", None, 1.0, num_splits=2)
    assert torch.equal(out, torch.zeros_like(out))
    write_kv(torch.randn(2, hkv, d), torch.randn(2, hkv, d), k_cache, k_cache.clone(), torch.tensor([-1, -1]))
    assert torch.isnan(k_cache).all()


@pytest.mark.parametrize("dtype", slow_except([torch.bfloat16, torch.float16], 0))
@pytest.mark.parametrize("query_dtype", slow_except([None, torch.float32], 1), ids=["same", "fp32-query"])
def test_half_storage(dtype, query_dtype):
    run_step(3, "sliding", 9, 8, [(0, 11), (30, 1), (12, 5)], dtype=dtype, d=32, query_dtype=query_dtype)
    run_step(4, "full", None, 8, [(20, 1), (9, 1)], dtype=dtype, d=32, num_splits=2, query_dtype=query_dtype)


def test_head_size_256_and_gqa_8():
    run_step(5, "chunked", 16, 16, [(0, 9), (17, 1)], hq=8, hkv=1, d=256)


def test_query_blocks_example():
    assert query_blocks([0, 7], [5, 1], 4) == [0, 0, 0, 4, 0, 4, 4, 1, 1, 5, 7, 1]


def test_decode_splits_rule():
    assert decode_splits(64, 8, 100_000, 64) == 1  # 512 programs already
    assert decode_splits(1, 1, 100_000, 64) == 16
    assert decode_splits(1, 1, 100, 64) == 1  # 2 tiles: no split
