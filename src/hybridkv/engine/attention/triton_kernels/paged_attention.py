"""Paged attention in Triton: queries read K/V straight from the paged storage.

One kernel serves a step's prefill chunks and its decodes (varlen). A *query block*
is up to ``BLOCK_Q`` consecutive queries of one sequence; a program takes one query
block and one KV head, so its ``BLOCK_M = BLOCK_Q * rep`` rows are (query, query head)
pairs that share the KV head (GQA: head ``h`` reads KV head ``h // rep``). It walks the
keys of its sequence tile by tile through the block table, from the first key its
*first* query may see to its last query (online softmax, fp32)::

    full       keys [0, p]                 -> tiles from 0
    sliding W  keys (p - W, p]             -> tiles from p_first - W + 1
    chunked C  keys [floor(p/C)*C, p]      -> tiles from the first query's chunk start

so a sliding layer reads at most ``W + BLOCK_Q - 1`` keys per program and a chunked one
at most its chunk plus ``BLOCK_Q - 1``, whatever the context; a key outside a row's own
range is masked per row. A load is masked unless its key is in the program's range, so
the null blocks a table holds below the range (and a table's padding) are never read.

Worked example (block size 4, sliding W = 3, a 5-token prefill chunk at positions
8..12, ``BLOCK_Q`` = 4, ``BLOCK_N`` = 4): two query blocks, positions 8..11 and 12.
The first reads keys [6, 12) -> tiles [4, 8) and [8, 12) (keys 4, 5 masked); row
p = 9 keeps keys 7, 8, 9. The second reads keys [10, 13) -> tiles [8, 12), [12, 16).

Decode (``BLOCK_Q = 1``) may split a sequence's key range across ``num_splits``
programs (flash-decoding): each writes its unnormalised output with its running max
and sum, and a second kernel merges the splits. Learned sinks (GPT-OSS) join the
softmax denominator when a row is finished (or merged); soft-capping is
``c * tanh(s / c)`` on the scaled scores.

Two sources (``new_kv``, a ``tail_only`` group's prefill whose dead blocks were never stored):
a key at or past its sequence's ``new_from`` (the step's first position) is read from the
step's own K / V rows (``new_row`` + its offset), rounded to the cache dtype as a write would,
the rest through the table: the same values a query would read had they all been stored.

Shapes: q [T, Hq, D]; a layer's K and V caches [Hkv, num_blocks, block_size, D] each
(views of :class:`~hybridkv.engine.kv_storage.PagedKVStorage`'s tensors); table [S, W];
seq_lens [S] (keys of each sequence after this step's writes). Output [T, Hq, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.engine.attention.triton_kernels import interpreter_on

__all__ = [
    "KIND_CODES", "KEY_END", "block_q_for", "decode_splits", "num_sms", "paged_attention_fwd",
    "query_blocks", "tile_n",
]

#: the kernel's code of each attention kind
KIND_CODES = {"full": 0, "sliding": 1, "chunked": 2}
#: no upper key limit (int32: the kernel's positions)
KEY_END = 2**31 - 1


@triton.jit
def _first_key(pos, KIND: tl.constexpr, size):
    """Smallest key position a query at ``pos`` may see."""
    if KIND == 1:
        return tl.maximum(pos - size + 1, 0)
    elif KIND == 2:
        return (pos // size) * size
    else:
        return pos * 0


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attention_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, plan_ptr, sinks_ptr,
    part_acc_ptr, part_ml_ptr, lse_ptr, nk_ptr, nv_ptr, new_from_ptr, new_row_ptr,
    scale, softcap, size, key_start, key_end,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kh, stride_kb, stride_ko, stride_vh, stride_vb, stride_vo, stride_ts,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    NUM_HEADS: tl.constexpr, REP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr,
    KIND: tl.constexpr, DECODE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    OUT_LSE: tl.constexpr, FRESH: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # query block b = sequence b's one new token (row b), at position seq_len - 1
        seq = qb
        row0 = qb
        seq_len = tl.load(seq_lens_ptr + seq)
        pos0 = seq_len - 1
        n_q = tl.minimum(seq_len, 1)  # a padded row (seq_len 0) has no query
    else:  # plan rows: (sequence, first flat row, first position, queries)
        seq = tl.load(plan_ptr + qb * 4)
        row0 = tl.load(plan_ptr + qb * 4 + 1)
        pos0 = tl.load(plan_ptr + qb * 4 + 2)
        n_q = tl.load(plan_ptr + qb * 4 + 3)

    r = tl.arange(0, BLOCK_M)
    qi = r // REP  # query of the block
    head = kv_head * REP + r % REP  # query head
    head_ok = r < BLOCK_Q * REP
    row_ok = (qi < n_q) & head_ok
    pos = pos0 + qi  # [BLOCK_M]
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD

    q = tl.load(
        q_ptr + (row0 + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [BLOCK_M, HEAD_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    lo = tl.maximum(_first_key(pos0, KIND, size), key_start)
    hi = tl.minimum(pos0 + n_q, key_end)  # keys [lo, hi)
    row_lo = _first_key(pos, KIND, size)  # [BLOCK_M]
    t_first = lo // BLOCK_N
    num_tiles = tl.where(n_q > 0, (hi + BLOCK_N - 1) // BLOCK_N - t_first, 0)
    per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_begin = t_first + split * per_split
    t_end = tl.minimum(t_begin + per_split, t_first + num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    if FRESH:  # keys from new_from on are the step's own rows (two sources)
        new_from = tl.load(new_from_ptr + seq)
        new_row = tl.load(new_row_ptr + seq)
    for t in range(t_begin, t_end):
        j = t * BLOCK_N + n  # key positions [BLOCK_N]
        j_ok = (j >= lo) & (j < hi)
        paged_ok = j_ok
        if FRESH:
            fresh = j >= new_from
            paged_ok = j_ok & (j < new_from)
        blk = tl.load(table_ptr + seq * stride_ts + j // PAGE, mask=paged_ok, other=0).to(tl.int64)  # int32 too
        off = j % PAGE
        kv_mask = paged_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + kv_head * stride_kh + blk[:, None] * stride_kb + off[:, None] * stride_ko + d[None, :],
            mask=kv_mask, other=0.0,
        )  # [BLOCK_N, HEAD_PAD]
        v = tl.load(
            v_ptr + kv_head * stride_vh + blk[:, None] * stride_vb + off[:, None] * stride_vo + d[None, :],
            mask=kv_mask, other=0.0,
        )
        if FRESH:  # rounded to the cache dtype, as if written and read back
            row = (new_row + tl.maximum(j - new_from, 0)).to(tl.int64)
            new_mask = (j_ok & fresh)[:, None] & d_ok[None, :]
            kn = tl.load(nk_ptr + row[:, None] * stride_nkt + kv_head * stride_nkh + d[None, :], mask=new_mask,
                         other=0.0)
            vn = tl.load(nv_ptr + row[:, None] * stride_nvt + kv_head * stride_nvh + d[None, :], mask=new_mask,
                         other=0.0)
            k = tl.where(fresh[:, None], kn.to(k_ptr.dtype.element_ty), k)
            v = tl.where(fresh[:, None], vn.to(v_ptr.dtype.element_ty), v)
        if UPCAST:
            s = _dot(q, tl.trans(k.to(tl.float32)), IEEE)
        else:
            s = _dot(q, tl.trans(k.to(q.dtype)), IEEE)
        s = s * scale  # [BLOCK_M, BLOCK_N] fp32
        if HAS_SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # c * tanh(s / c)
        seen = (j[None, :] <= pos[:, None]) & (j[None, :] >= row_lo[:, None]) & j_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = _dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), IEEE)
        else:
            pv = _dot(p.to(v.dtype), v, IEEE)
        acc = acc * alpha[:, None] + pv
        m = m_new

    if OUT_LSE:  # a cascade pass: log-sum-exp of the row's scores, for the merge (no sinks here)
        lse = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + (row0 + qi) * NUM_HEADS + head, lse, mask=row_ok)
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink's logit joins the denominator
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_all = tl.maximum(m, sink)
            l = l * tl.exp(m - m_all) + tl.exp(sink - m_all)
            acc = acc * tl.exp(m - m_all)[:, None]
        l = tl.where(l == 0.0, 1.0, l)
        out = acc / l[:, None]
        tl.store(
            out_ptr + (row0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:  # partials [rows, Hq, splits, D] and (max, sum) [rows, Hq, splits, 2]; BLOCK_Q == 1
        base = (row0 * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        # a padded row (no query) stores an empty split too: its merge gives 0, never garbage
        tl.store(part_acc_ptr + base[:, None] * HEAD_PAD + d[None, :], acc, mask=head_ok[:, None])
        tl.store(part_ml_ptr + base * 2, m, mask=head_ok)
        tl.store(part_ml_ptr + base * 2 + 1, l, mask=head_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < NUM_SPLITS
    base = (row * NUM_HEADS + head) * NUM_SPLITS + sp  # [SPLITS_PAD]
    m = tl.load(part_ml_ptr + base * 2, mask=sp_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + base * 2 + 1, mask=sp_ok, other=0.0)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_safe)  # [SPLITS_PAD]; an empty split (max -inf) weighs 0
    total = tl.sum(l * w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_n(head_size: int) -> int:
    """Keys per tile: 64 for heads up to 128, 32 above (registers); 16 in the interpreter."""
    if interpreter_on():
        return 16
    return 64 if _pow2(head_size) <= 128 else 32


def block_q_for(rep: int, decode: bool) -> int:
    """Queries per program: one for decode, else enough for ~64 rows (``BLOCK_Q * rep``)."""
    if decode:
        return 1
    return max(1, 64 // _pow2(rep))


def query_blocks(
    starts: list[int], q_lens: list[int], block_q: int, rows: list[int] | None = None,
    seqs: list[int] | None = None,
) -> list[int]:
    """The plan rows ``(sequence, first flat row, first position, queries)``, flattened.

    Sequence ``s`` computes ``q_lens[s]`` queries from position ``starts[s]``; its first
    flat row is ``rows[s]`` (default: the running sum of ``q_lens``) and its block table
    row ``seqs[s]`` (default ``s``). Example: starts [0, 7], q_lens [5, 1], block_q 4 ->
    [0, 0, 0, 4,  0, 4, 4, 1,  1, 5, 7, 1].
    """
    out: list[int] = []
    row = 0
    for s, (a, n) in enumerate(zip(starts, q_lens)):
        r = rows[s] if rows is not None else row
        seq = seqs[s] if seqs is not None else s
        for i in range(0, n, block_q):
            out.extend((seq, r + i, a + i, min(block_q, n - i)))
        row += n
    return out


def decode_splits(num_seqs: int, num_kv_heads: int, max_keys: int, block_n: int, num_sms: int = 132) -> int:
    """How many programs share one decode row's keys: enough programs to fill ``2 * num_sms``,
    never more than one per 4 key tiles, at most 16 (1 when ``max_keys`` fits 4 tiles)."""
    want = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    by_keys = max(1, -(-max_keys // (4 * block_n)))
    return int(max(1, min(16, want, by_keys)))


def paged_attention_fwd(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    kind: str,
    size: int | None,
    scale: float,
    *,
    plan: torch.Tensor | None = None,
    num_blocks_q: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    key_start: int = 0,
    key_end: int = KEY_END,
    lse: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attend ``query`` [T, Hq, D] through ``table`` over the paged caches; returns [T, Hq, D].

    plan: the :func:`query_blocks` rows as an int tensor [NQB, 4] (``num_blocks_q`` = NQB),
    built with ``block_q_for(rep, False)``; None: a decode batch, row ``s`` is sequence
    ``s``'s token at position ``seq_lens[s] - 1`` (``seq_lens[s] == 0``: a padded row,
    left untouched). ``num_splits`` > 1 only for decode. ``key_start`` / ``key_end`` limit every
    row to keys in ``[key_start, key_end)`` (the two passes of cascade attention); ``lse`` [T, Hq]
    fp32 receives each row's log-sum-exp (then leave ``sinks`` to :func:`merge_attention`).
    ``new_kv`` = (key [T, Hkv, D], value, new_from [S], new_row [S]): sequence ``s``'s keys at
    positions ``>= new_from[s]`` are rows ``new_row[s] + (p - new_from[s])`` of the step's key /
    value (two sources; plan steps only).
    """
    num_tokens, num_heads, head = query.shape
    num_kv, _, page, _ = key_cache.shape
    rep = num_heads // num_kv
    decode = plan is None
    if not decode and num_splits != 1:
        raise ValueError("split keys only for decode batches")
    block_q = 1 if decode else block_q_for(rep, False)
    block_m = max(16, _pow2(block_q * rep))
    head_pad = max(16, _pow2(head))
    block_n = tile_n(head)
    if out is None:
        out = torch.empty_like(query)
    grid_q = table.shape[0] if decode else int(num_blocks_q if num_blocks_q is not None else plan.shape[0])
    if grid_q == 0:
        return out
    # fp32 dots: the interpreter's bf16 dot is wrong; an fp32 query over a bf16 / fp16 cache
    # (--kv-cache-dtype) reads the stored values in fp32 (no mixed-dtype dot, no tf32)
    upcast = (interpreter_on() and query.dtype == torch.bfloat16) or query.dtype != key_cache.dtype
    ieee = query.dtype == torch.float32 or upcast
    dummy = seq_lens
    if num_splits > 1:
        part_acc = torch.empty(num_tokens * num_heads * num_splits * head_pad, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_tokens * num_heads * num_splits * 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = dummy
    if lse is not None and (num_splits != 1 or sinks is not None):
        raise ValueError("a cascade pass (lse) takes neither splits nor sinks")
    if new_kv is not None and decode:
        raise ValueError("two sources (new_kv) only for plan steps")
    nk, nv, new_from, new_row = new_kv if new_kv is not None else (query, query, dummy, dummy)
    _attention_kernel[(grid_q, num_kv, num_splits)](
        query, out, key_cache, value_cache, table, seq_lens, plan if plan is not None else dummy,
        sinks if sinks is not None else dummy, part_acc, part_ml, lse if lse is not None else dummy,
        nk, nv, new_from, new_row,
        float(scale), float(softcap or 0.0), int(size or 0), int(key_start), int(key_end),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), table.stride(0),
        nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1),
        NUM_HEADS=num_heads, REP=rep, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, HEAD=head,
        HEAD_PAD=head_pad, PAGE=page, KIND=KIND_CODES[kind], DECODE=decode, NUM_SPLITS=num_splits,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None, UPCAST=upcast, IEEE=ieee,
        OUT_LSE=lse is not None, FRESH=new_kv is not None, num_warps=8 if head_pad >= 256 and block_m >= 64 else 4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(grid_q, num_heads)](
            out, part_acc, part_ml, sinks if sinks is not None else dummy, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, _pow2(num_splits)),
            HEAD=head, HEAD_PAD=head_pad, HAS_SINKS=sinks is not None,
        )
    return out


_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132, an H200's, stands in elsewhere)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
