"""How one step's queries are cut into padded batches for one attention type.

The attention reads, for each query, only the keys its mask allows (full: ``[0, p]``,
sliding ``W``: ``(p - W, p]``, chunked ``C``: ``[floor(p/C)*C, p]``). Padding every
sequence of a step to the longest query run and key range (a 250-token prefill next to
31 decodes) would make most of the work padding, so a step is cut into *segments*
first and the segments are batched by shape:

* a segment is a run of one sequence's queries ``[a, b)`` that reads the key range
  ``[first_key(a), b)``. Chunked attention cuts at chunk boundaries (a 250-token
  prefill with chunk 64 is four segments of at most 64 x 64, not 250 x 250) and
  sliding attention at multiples of ``min(W, SLIDING_PIECE)`` (at most ``L`` queries x
  ``L + W - 1`` keys for that piece length ``L``: a 2,048-token chunk at ``W`` 512 is 16
  segments of 128 x 639, 1.25x the keys its queries read, where pieces of ``W`` would be
  4 of 512 x 1,023, 2x);
  full attention keeps one segment per sequence;
* single-query segments (decodes, and one-token tails) form one *decode bucket*;
* the others are sorted by size and greedily grouped while padding stays under
  ``PAD_SLACK`` x the real work. A bucket whose segments read only their own new
  keys (a fresh prefill, a chunk started in this step) is plain causal and needs no
  mask tensor.

Padded query rows repeat the segment's last query and padded keys repeat its last
key (a live, written slot), so no row is all ``-inf`` and no unwritten slot is read.
:class:`Layout` depends only on the attention type and the step's positions, so all
groups of one type share it; :meth:`Layout.key_slots` maps its key positions through
one group's block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hybridkv.engine.host_tensors import long_tensor
from hybridkv.errors import InvariantViolation

__all__ = ["Bucket", "Layout", "build_layout", "first_key", "visible_keys", "PAD_SLACK"]

#: a multi-query bucket grows while its padded work stays below this multiple of the real work
PAD_SLACK = 1.5
#: a sliding window's prefill is cut into pieces of this many queries at most (each reads its
#: own keys and the W - 1 before): shorter pieces read fewer keys they mask out, more of them
#: cost more ops and gathers (README, "Long context", has the prefill it was chosen on)
SLIDING_PIECE = 128
#: the single-query segments (decodes) of a step form one bucket while it pads to at most this
#: many keys; past it they are grouped by key length as the others (PAD_SLACK). Short contexts
#: gain nothing from more buckets (more ops, measured slower); 27 decodes of 32-1,500 tokens
#: gathered ~2x the keys they read into one bucket.
DECODE_SPLIT_KEYS = 8192


def visible_keys(kind: str, size: int | None, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool mask, True where query position ``q_pos[..., i, None]`` may see ``k_pos[..., None, j]``."""
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    allowed = k <= q
    if kind == "sliding":
        allowed &= k > q - size
    elif kind == "chunked":
        allowed &= torch.div(k, size, rounding_mode="floor") == torch.div(q, size, rounding_mode="floor")
    return allowed


def first_key(kind: str, size: int | None, p: int) -> int:
    """Smallest key position a query at position ``p`` may see (full 0, sliding ``p - W + 1``, chunked its chunk's start)."""
    if kind == "sliding":
        return max(0, p - size + 1)
    if kind == "chunked":
        return p // size * size
    return 0


def _pieces(kind: str, size: int | None, a: int, b: int) -> list[tuple[int, int]]:
    """Cut the query run ``[a, b)`` at multiples of the chunk, or of the window's piece length
    (full: no cut)."""
    if kind == "full":
        return [(a, b)]
    step = min(size, SLIDING_PIECE) if kind == "sliding" else size
    out = []
    while a < b:
        cut = min(b, (a // step + 1) * step)
        out.append((a, cut))
        a = cut
    return out


class _Segment(NamedTuple):
    seq: int  # sequence (row of the block tables)
    tok: int  # flat index of its first query token
    q_first: int  # position of its first query
    n: int  # queries
    k_first: int  # position of its first key; keys run to q_first + n - 1
    new_from: int  # its sequence's first position computed this step
    new_tok: int  # flat K/V row of that position

    @property
    def k_len(self) -> int:
        return self.q_first + self.n - self.k_first

    @property
    def causal(self) -> bool:
        """Reads only its own queries' keys, so the mask is plain causal."""
        return self.k_first == self.q_first


@dataclass(slots=True)
class Bucket:
    """``num`` segments padded to ``q`` queries x ``k`` keys, attended as one batch.

    ``seq`` [B] (block table row of each segment) and ``k_pos`` [B, K] locate the keys;
    ``q_rows`` [B * Q] is the flat token of each padded query row (None: the rows are
    tokens ``0..T-1``); ``out_rows`` / ``tokens`` [n] say which rows are real and which
    tokens they are (None: every row, tokens ``0..T-1`` in order). ``causal``: no mask
    tensor needed. Biases are built on first use and shared by the layers of the step.
    ``new_from`` [B]: keys at or past it were computed this step, the step's K/V row of
    key position ``p`` being ``p + k_src`` (``k_src`` [B]; see :meth:`fresh_keys`).
    """

    num: int
    q: int
    k: int
    causal: bool
    seq: torch.Tensor
    all_seqs: bool  # seq is 0..B-1: the table's first B rows, no index_select
    k_pos: torch.Tensor
    k_block: torch.Tensor  # [B, K] k_pos // block_size
    k_offset: torch.Tensor  # [B, K] k_pos % block_size
    q_rows: torch.Tensor | None
    out_rows: torch.Tensor | None
    tokens: torch.Tensor | None
    _mask: torch.Tensor | None  # [B, Q, K] bool, None when causal
    new_from: torch.Tensor  # [B] first position of the segment's sequence computed this step
    k_src: torch.Tensor  # [B] the step's K/V row of key position p is p + k_src
    _biases: dict[object, torch.Tensor] = field(default_factory=dict)

    def fresh_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(dest [n], src [n]): padded keys ``dest`` (flat ``b * K + j``) are this step's own,
        K/V rows ``src`` of the step (a tail_only group reads them there: unstored in its gap).

        Example: one segment, keys at positions 6..9 (K 4), its sequence computing from 8 with
        position 8 at row 0: dest [2, 3], src [0, 1]."""
        got = self._biases.get("fresh")
        if got is None:
            fresh = (self.k_pos >= self.new_from.unsqueeze(1)).view(-1)  # [B * K]
            dest = fresh.nonzero().squeeze(1)
            src = (self.k_pos + self.k_src.unsqueeze(1)).view(-1).index_select(0, dest)
            got = self._biases["fresh"] = (dest, src)
        return got

    def bias(self) -> torch.Tensor:
        """``[B, 1, Q, K]`` fp32: 0 where the key is visible, ``-inf`` elsewhere."""
        got = self._biases.get("4d")
        if got is None:
            mask = self._mask
            if mask is None:  # causal: row i sees keys j <= i (bool tril() is ~100x slower on CPU)
                device = self.k_pos.device
                mask = torch.arange(self.k, device=device) <= torch.arange(self.q, device=device).unsqueeze(1)
                mask = mask.expand(self.num, self.q, self.k)
            got = torch.where(mask, 0.0, float("-inf")).to(torch.float32).unsqueeze(1)
            self._biases["4d"] = got
        return got

    def bias_by_kv_head(self, num_kv_heads: int, rep: int) -> torch.Tensor:
        """The bias laid out like the manual kernel's scores: ``[Hkv * B, rep * Q, K]``."""
        key = (num_kv_heads, rep)
        got = self._biases.get(key)
        if got is None:
            b = self.bias().view(1, self.num, 1, self.q, self.k)
            got = b.expand(num_kv_heads, self.num, rep, self.q, self.k).reshape(
                num_kv_heads * self.num, rep * self.q, self.k
            )
            self._biases[key] = got
        return got


@dataclass(slots=True)
class Layout:
    """The buckets of one attention type in one step (shared by all its groups)."""

    kind: str
    size: int | None
    buckets: list[Bucket]

    @property
    def in_order(self) -> bool:
        """One bucket whose rows are exactly the step's tokens in order (a pure decode step)."""
        return len(self.buckets) == 1 and self.buckets[0].tokens is None

    def key_slots(self, table: torch.Tensor, block_size: int, check: bool, group: int,
                  fresh: bool = False) -> list[torch.Tensor]:
        """Per bucket, the slot of each padded key [B * K] through ``table`` [S, max_blocks].

        ``check``: refuse (InvariantViolation) a needed key that the table maps to the null block
        (``fresh``: the step's own keys are read from its K/V, so only earlier ones count).
        """
        out = []
        for b in self.buckets:
            rows = table[: b.num] if b.all_seqs else table.index_select(0, b.seq)  # [B, max_blocks]
            blocks = rows.gather(1, b.k_block)  # [B, K]
            if check:
                null = blocks == 0
                if fresh:
                    null &= b.k_pos < b.new_from.unsqueeze(1)
                if bool(null.any()):
                    row, col = null.nonzero()[0].tolist()
                    raise InvariantViolation(
                        f"group {group} ({self.kind}): sequence {int(b.seq[row])} needs key position "
                        f"{int(b.k_pos[row, col])}, which its block table maps to the null block"
                    )
            out.append((blocks * block_size + b.k_offset).view(-1))
        return out


def build_layout(
    kind: str,
    size: int | None,
    starts: list[int],
    q_lens: list[int],
    block_size: int,
    device: torch.device,
    seqs: list[int] | None = None,
    new_from: list[int] | None = None,
    new_tok: list[int] | None = None,
) -> Layout:
    """Segments and buckets for sequences computing ``q_lens[s]`` tokens from position ``starts[s]``.

    seqs: the block table row of each entry (default: entry ``s`` is row ``s``). new_from /
    new_tok: the first position its sequence computes this step and that position's K/V row
    (default: ``starts[s]`` and the running sum of ``q_lens``; the last-token layout of a
    step's outputs gives its sequences' own).
    """
    single: list[_Segment] = []
    multi: list[_Segment] = []
    tok = 0
    rows = seqs if seqs is not None else range(len(starts))
    for i, (s, a0, n0) in enumerate(zip(rows, starts, q_lens)):
        nf, nt = (a0, tok) if new_from is None else (new_from[i], new_tok[i])
        for a, b in _pieces(kind, size, a0, a0 + n0) if n0 > 1 else [(a0, a0 + 1)]:
            seg = _Segment(s, tok + a - a0, a, b - a, first_key(kind, size, a), nf, nt)
            (single if seg.n == 1 else multi).append(seg)
        tok += n0
    buckets = []
    if single:  # one bucket, unless padding it to the longest key range would gather too much
        padded = len(single) * max(g.k_len for g in single)
        groups = _group(single) if padded > DECODE_SPLIT_KEYS else [single]
        buckets += [_bucket(kind, size, g, False, tok, block_size, device) for g in groups]
    for causal in (True, False):
        for group in _group([g for g in multi if g.causal == causal]):
            buckets.append(_bucket(kind, size, group, causal, tok, block_size, device))
    return Layout(kind, size, buckets)


def _group(segs: list[_Segment]) -> list[list[_Segment]]:
    """Largest first; a new bucket when padding would exceed ``PAD_SLACK`` x the real work."""
    segs = sorted(segs, key=lambda g: (g.k_len, g.n), reverse=True)
    groups: list[list[_Segment]] = []
    cur: list[_Segment] = []
    q_max = k_max = real = 0
    for g in segs:
        q2, k2 = max(q_max, g.n), max(k_max, g.k_len)
        if cur and (len(cur) + 1) * q2 * k2 > PAD_SLACK * (real + g.n * g.k_len):
            groups.append(cur)
            cur, real, q2, k2 = [], 0, g.n, g.k_len
        cur.append(g)
        q_max, k_max, real = q2, k2, real + g.n * g.k_len
    if cur:
        groups.append(cur)
    return groups


def _bucket(
    kind: str,
    size: int | None,
    segs: list[_Segment],
    causal: bool,
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> Bucket:
    """A bucket of ``segs`` from a step of ``num_tokens`` query tokens.

    Both shortcuts are read off the segments themselves, never off the step's shape (a
    step of only 1-query segments may still hold several segments of one sequence: a
    2-token prefill with window 1, or one that crosses a chunk boundary):

    * ``whole``: segment ``b`` is the single query token ``b`` and there are ``num_tokens``
      of them (rows need no index_select, outputs no scatter);
    * ``all_seqs``: segment ``b`` reads block table row ``b`` (the table's first ``B`` rows
      need no index_select; ``gather`` reads only those rows of a taller table).
    """
    whole = len(segs) == num_tokens and all(g.n == 1 and g.tok == b for b, g in enumerate(segs))
    all_seqs = all(g.seq == b for b, g in enumerate(segs))
    fields = [v for g in segs for v in (g.seq, g.tok, g.q_first, g.n, g.k_first, g.k_len, g.new_from,
                                        g.new_tok - g.new_from)]
    seq, tok, q_first, n, k_first, k_len, new_from, k_src = long_tensor(fields, device).view(-1, 8).unbind(1)  # [B]
    num, q, k = len(segs), max(g.n for g in segs), max(g.k_len for g in segs)
    j = torch.arange(k, device=device)  # [K]
    k_pos = k_first.unsqueeze(1) + torch.minimum(j.unsqueeze(0), (k_len - 1).unsqueeze(1))  # [B, K]
    k_valid = j.unsqueeze(0) < k_len.unsqueeze(1)  # [B, K]
    if q == 1:
        mask = None if causal else k_valid.unsqueeze(1)  # [B, 1, K]: a lone query sees its whole key range
        q_rows = None if whole else tok
        out_rows, tokens = None, (None if whole else tok)
    else:
        i = torch.arange(q, device=device)  # [Q]
        qi = torch.minimum(i.unsqueeze(0), (n - 1).unsqueeze(1))  # [B, Q] padded rows repeat the last query
        rows = tok.unsqueeze(1) + qi  # [B, Q]
        mask = None
        if not causal:
            q_pos = q_first.unsqueeze(1) + qi  # [B, Q]
            mask = visible_keys(kind, size, q_pos, k_pos) & k_valid.unsqueeze(1)  # [B, Q, K]
        q_rows = rows.reshape(-1)  # [B * Q]
        out_rows = (i.unsqueeze(0) < n.unsqueeze(1)).view(-1).nonzero().squeeze(1)  # [n_real]
        tokens = q_rows[out_rows]
    k_block = torch.div(k_pos, block_size, rounding_mode="floor")  # [B, K] index into a block table row
    return Bucket(num, q, k, causal, seq, all_seqs, k_pos, k_block, k_pos % block_size, q_rows, out_rows, tokens, mask,
                  new_from, k_src)
