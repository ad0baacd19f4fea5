"""How a step's queries are cut into segments and batched into buckets (engine/attention/plan.py)."""

from __future__ import annotations

import random

import torch

from hybridkv.engine.attention.plan import PAD_SLACK, build_layout
from hybridkv.engine.host_tensors import long_tensor

CPU = torch.device("cpu")


def _shapes(layout):
    return [(b.num, b.q, b.k, b.causal) for b in layout.buckets]


def test_chunked_prefill_is_cut_at_chunk_boundaries():
    # 250 fresh tokens, chunk 64: four causal segments of <= 64 x 64, not one 250 x 250
    layout = build_layout("chunked", 64, [0], [250], 16, CPU)
    assert _shapes(layout) == [(4, 64, 64, True)]
    b = layout.buckets[0]
    assert sorted(b.tokens.tolist()) == list(range(250))  # every token exactly once
    assert b.k_pos[3].tolist()[:58] == list(range(192, 250))  # the last chunk's keys
    assert b.k_pos[3, 58:].tolist() == [249] * 6  # padded keys repeat its last (live) key


def test_continued_prefill_reads_its_chunk_history():
    # 40 tokens from position 100, chunk 64: [100, 128) reads keys from 64 (masked), [128, 140) is fresh
    layout = build_layout("chunked", 64, [100], [40], 16, CPU)
    assert sorted(_shapes(layout)) == [(1, 12, 12, True), (1, 28, 64, False)]
    masked = next(b for b in layout.buckets if not b.causal)
    bias = masked.bias()[0, 0]  # [Q, K]: query 100 + i sees keys 64 .. 100 + i
    assert [(row == 0).sum().item() for row in bias] == [37 + i for i in range(28)]


def test_sliding_prefill_is_cut_at_window_multiples():
    layout = build_layout("sliding", 16, [0], [40], 8, CPU)
    # [0, 16) fresh; [16, 32) reads from 1, [32, 40) from 17: at most W queries x 2W - 1 keys
    assert sorted(_shapes(layout)) == [(1, 16, 16, True), (2, 16, 31, False)]


def test_a_wide_window_prefill_is_cut_into_shorter_pieces(monkeypatch):
    """Past SLIDING_PIECE queries a window's prefill is cut at multiples of the piece, each piece
    reading its own keys and the W - 1 before (so most of what a piece gathers is read), and
    every query still reads exactly its visible keys; a piece length that is not the window's
    divisor included."""
    from hybridkv.engine.attention import plan

    assert plan.SLIDING_PIECE == 128
    layout = build_layout("sliding", 512, [0], [2048], 16, CPU)
    shapes = _shapes(layout)
    assert max(q for _, q, _, _ in shapes) == 128 and max(k for _, _, k, _ in shapes) == 128 + 511
    assert sum(n * q for n, q, _, _ in shapes) == 2048
    monkeypatch.setattr(plan, "SLIDING_PIECE", 5)
    rng = random.Random(3)
    for _ in range(60):
        size, bs = rng.randint(6, 23), rng.randint(1, 8)
        num = rng.randint(1, 4)
        starts = [rng.choice([0, rng.randint(0, 60)]) for _ in range(num)]
        q_lens = [rng.randint(1, 40) for _ in range(num)]
        layout = _check_layout("sliding", size, starts, q_lens, bs)
        assert all(b.q <= 5 and b.k <= 5 + size - 1 for b in layout.buckets)


def test_decode_step_is_one_bucket_in_token_order():
    layout = build_layout("full", None, [5, 70, 12], [1, 1, 1], 16, CPU)
    (b,) = layout.buckets
    assert layout.in_order and b.all_seqs and b.q_rows is None and b.tokens is None
    assert (b.num, b.q, b.k) == (3, 1, 71)
    assert b.k_pos[0].tolist() == list(range(6)) + [5] * 65
    table = long_tensor(range(1, 1 + 3 * 8)).view(3, 8)  # sequence s owns blocks 8s+1 ..
    slots = layout.key_slots(table, 16, check=True, group=0)[0].view(3, 71)
    assert slots[1, 70].item() == table[1, 70 // 16].item() * 16 + 70 % 16


def test_mixed_step_keeps_decodes_apart_and_groups_prefills_by_size():
    starts, lens = [0, 0, 0, 0, 300], [250, 240, 60, 50, 1]
    layout = build_layout("full", None, starts, lens, 16, CPU)
    shapes = _shapes(layout)
    assert shapes[0] == (1, 1, 301, False)  # the decode
    assert sorted(shapes[1:]) == [(2, 60, 60, True), (2, 250, 250, True)]
    for b in layout.buckets[1:]:
        real = sum(int(n) * int(n) for n in (b.k_pos[:, -1] - b.k_pos[:, 0] + 1))
        assert b.num * b.q * b.k <= PAD_SLACK * real
    covered = sorted(t for b in layout.buckets for t in b.tokens.tolist())
    assert covered == list(range(sum(lens)))


def test_rows_and_tables_follow_seqs():
    # one query per chosen sequence (the last-token layout): table rows 2 and 0
    layout = build_layout("chunked", 8, [19, 4], [1, 1], 4, CPU, seqs=[2, 0])
    (b,) = layout.buckets
    assert b.seq.tolist() == [2, 0] and not b.all_seqs and layout.in_order
    table = long_tensor(range(30)).view(3, 10)
    slots = layout.key_slots(table, 4, check=False, group=0)[0].view(2, -1)
    assert slots[0, :4].tolist() == [table[2, 4].item() * 4 + i for i in range(4)]  # keys 16..19 of row 2


# --- every step shape -----------------------------------------------------------------------


def _slot(table, seq: int, pos: int, bs: int) -> int:
    return int(table[seq, pos // bs]) * bs + pos % bs


def _check_layout(kind, size, starts, q_lens, bs, seqs=None, num_rows=None):
    """Every query token exactly once, reading exactly the slots of the keys it may see."""
    rows = list(seqs) if seqs is not None else list(range(len(starts)))
    num_rows = num_rows or len(starts)
    layout = build_layout(kind, size, starts, q_lens, bs, CPU, seqs=seqs)
    width = max(-(-(a + n) // bs) for a, n in zip(starts, q_lens))
    table = long_tensor(range(1, 1 + num_rows * width)).view(num_rows, width)  # every block distinct
    slots = layout.key_slots(table, bs, check=True, group=0)
    want: dict[int, set[int]] = {}  # flat token -> the slots it must read
    tok = 0
    for s, a, n in zip(rows, starts, q_lens):
        for p in range(a, a + n):
            lo = {"full": 0, "sliding": max(0, p - (size or 1) + 1), "chunked": p // (size or 1) * (size or 1)}[kind]
            want[tok] = {_slot(table, s, k, bs) for k in range(lo, p + 1)}
            tok += 1
    got: dict[int, set[int]] = {}
    for b, k_slots in zip(layout.buckets, slots):
        k_slots = k_slots.view(b.num, b.k).tolist()
        seen = (b.bias()[:, 0] == 0).tolist()  # [B][Q][K]
        q_rows = b.q_rows.tolist() if b.q_rows is not None else list(range(b.num))  # [B * Q]
        real = range(b.num * b.q) if b.out_rows is None else b.out_rows.tolist()
        for r in real:
            i, j = divmod(r, b.q)
            token = q_rows[r]
            assert token not in got, f"token {token} computed twice"
            got[token] = {slot for slot, ok in zip(k_slots[i], seen[i][j]) if ok}
        # padded keys are live: within the segment's own key range
        assert bool((b.k_pos <= b.k_pos[:, -1:]).all())
    assert got == want
    if layout.in_order:
        assert list(got) == list(range(tok))
    return layout


def test_one_query_pieces_of_one_sequence_are_not_a_decode_step():
    """A step of only 1-query segments, more segments than sequences (which once crashed)."""
    _check_layout("sliding", 1, [0], [2], 16)  # Mistral window 1, a 2-token prompt
    _check_layout("chunked", 5, [4], [2], 16)  # chunk 5, budget 2: tokens 4 | 5 cross a chunk
    _check_layout("chunked", 5, [4, 9], [2, 1], 1)  # prefix hit of 4 + 2 new, next to a decode
    _check_layout("chunked", 5, [9, 4], [1, 2], 1)
    (b,) = _check_layout("sliding", 1, [0, 7], [3, 1], 4).buckets
    assert b.seq.tolist() == [0, 0, 0, 1] and not b.all_seqs  # rows in token order, table rows by index


def test_every_step_shape_reads_exactly_the_visible_keys():
    """Seeded random steps: sizes 1..9, block 1..8, runs 1..20 from any position, any row order."""
    rng = random.Random(10)
    for _ in range(400):
        kind = rng.choice(["full", "sliding", "chunked"])
        size = None if kind == "full" else rng.randint(1, 9)
        bs = rng.randint(1, 8)
        num = rng.randint(1, 5)
        starts = [rng.choice([0, rng.randint(0, 40)]) for _ in range(num)]
        q_lens = [rng.choice([1, 1, 2, rng.randint(1, 20)]) for _ in range(num)]
        _check_layout(kind, size, starts, q_lens, bs)
        # the last-token layout: a subset of the rows, in any order, of a taller table
        extra = rng.randint(0, 3)
        seqs = rng.sample(range(num + extra), num)
        if rng.random() < 0.3:
            seqs = list(range(num))
        _check_layout(kind, size, [a + n - 1 for a, n in zip(starts, q_lens)], [1] * num, bs, seqs, num + extra)
