"""How a step's queries are cut into segments and batched into buckets (attention_plan)."""

from __future__ import annotations

import torch

from hybridkv.engine.attention_plan import PAD_SLACK, build_layout
from hybridkv.engine.host import long_tensor

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
