"""Reference paged attention over :class:`~hybridkv.engine.kv_storage.PagedKVStorage`.

A step computes a flat batch of ``T`` tokens from ``S`` sequences (varlen). Sequence
``s`` computes ``q_len[s]`` tokens at absolute positions
``start[s] .. start[s] + q_len[s] - 1`` (``start`` = tokens already computed) and
its group-``g`` block table maps position ``p`` to slot
``table[p // block_size] * block_size + p % block_size``.

Which keys a query at position ``p`` may see (HF transformers 5.24 conventions,
``masking_utils``; every model here uses them unchanged):

    full       k in [0, p]                              (causal)
    sliding W  k in (p - W, p]      i.e. k > p - W       (W keys, itself included)
    chunked C  k in [floor(p/C)*C, p]  i.e. k//C == p//C

For each (group, attention type) the step gathers, per sequence, only the key range
the sequence's queries can reach, ``[first_allowed(start), start + q_len)``; a block
in that range must not be the null block (checked: :class:`InvariantViolation`).
Sequences are padded to ``Qmax`` queries and ``Kmax`` keys so one layer is one
gather, one batched matmul and one masked softmax; padded key slots repeat a real
slot of the same sequence and are masked out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, InvariantViolation

__all__ = ["AttentionType", "FULL", "AttentionMetadata", "paged_attention", "allowed_key_mask"]


@dataclass(frozen=True, slots=True)
class AttentionType:
    """``kind`` is ``"full"``, ``"sliding"`` (``size`` = window) or ``"chunked"`` (``size`` = chunk)."""

    kind: str
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "full":
            if self.size is not None:
                raise InvalidConfigError("full attention takes no window/chunk size")
        elif self.kind in ("sliding", "chunked"):
            if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
                raise InvalidConfigError(f"{self.kind} attention needs a positive int size, got {self.size!r}")
        else:
            raise InvalidConfigError(f"unknown attention kind {self.kind!r}; expected full, sliding or chunked")

    def first_key(self, pos: torch.Tensor) -> torch.Tensor:
        """Smallest key position a query at ``pos`` may attend to (elementwise)."""
        if self.kind == "sliding":
            return (pos - self.size + 1).clamp(min=0)
        if self.kind == "chunked":
            return torch.div(pos, self.size, rounding_mode="floor") * self.size
        return torch.zeros_like(pos)

    def as_tuple(self) -> tuple[str, int | None]:
        return (self.kind, self.size)


FULL = AttentionType("full")


def allowed_key_mask(attn: AttentionType, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool mask, True where query position ``q_pos[..., i, None]`` may see ``k_pos[..., None, j]``."""
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    allowed = k <= q
    if attn.kind == "sliding":
        allowed &= k > q - attn.size
    elif attn.kind == "chunked":
        allowed &= torch.div(k, attn.size, rounding_mode="floor") == torch.div(q, attn.size, rounding_mode="floor")
    return allowed


@dataclass(slots=True)
class _GatherPlan:
    """What one (group, attention type) reads this step."""

    k_slots: torch.Tensor  # [S * Kmax] int64: slot of each padded key
    bias: torch.Tensor  # [S, 1, 1, Qmax, Kmax] float: 0 where allowed, -inf elsewhere
    k_max: int


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers of one step read, built once per step.

    Use :meth:`build`. Tensors: ``positions`` [T]; ``q_dest`` [T] (row of each token
    in the padded ``[S * Qmax]`` query layout); ``start`` / ``q_len`` / ``seq_len``
    [S]; ``block_tables[g]`` [S, max_blocks_g] (padded with the null block, which is
    never read); ``slot_mappings[g]`` [T].
    """

    storage: PagedKVStorage
    positions: torch.Tensor
    q_dest: torch.Tensor
    start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    q_max: int
    block_tables: list[torch.Tensor]
    slot_mappings: list[torch.Tensor]
    _plans: dict[tuple[int, AttentionType], _GatherPlan] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.start.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls,
        storage: PagedKVStorage,
        num_computed: Sequence[int],
        query_lens: Sequence[int],
        block_ids: Sequence[Sequence[Sequence[int]]],
    ) -> "AttentionMetadata":
        """Metadata for ``S`` sequences; ``block_ids[s][g]`` is sequence ``s``'s group-``g`` table."""
        device = storage.device
        bs = storage.block_size
        num_seqs = len(num_computed)
        if len(query_lens) != num_seqs or len(block_ids) != num_seqs:
            raise InvalidArgumentError("num_computed, query_lens and block_ids must have one entry per sequence")
        if num_seqs == 0:
            raise InvalidArgumentError("a step needs at least one sequence")
        for s, (n, q, tables) in enumerate(zip(num_computed, query_lens, block_ids)):
            if n < 0 or q <= 0:
                raise InvalidArgumentError(f"sequence {s}: need num_computed >= 0 and >= 1 new token, got {n}, {q}")
            if len(tables) != storage.num_groups:
                raise InvalidArgumentError(
                    f"sequence {s}: {len(tables)} block tables for {storage.num_groups} KV cache groups"
                )
            need = -(-(n + q) // bs)
            for g, table in enumerate(tables):
                if len(table) < need:
                    raise InvalidArgumentError(
                        f"sequence {s} group {g}: {len(table)} blocks cannot hold {n + q} tokens of block size {bs}"
                    )

        start = torch.tensor(list(num_computed), dtype=torch.long, device=device)  # [S]
        q_len = torch.tensor(list(query_lens), dtype=torch.long, device=device)  # [S]
        q_max = int(max(query_lens))
        seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_len)  # [T]
        cu = torch.cumsum(q_len, 0) - q_len  # [S] first flat token of each sequence
        offset = torch.arange(seq_ids.shape[0], device=device) - cu[seq_ids]  # [T] index within the sequence
        positions = start[seq_ids] + offset  # [T]
        q_dest = seq_ids * q_max + offset  # [T]

        block_tables: list[torch.Tensor] = []
        slot_mappings: list[torch.Tensor] = []
        for g in range(storage.num_groups):
            width = max(len(tables[g]) for tables in block_ids)
            rows = [list(tables[g]) + [0] * (width - len(tables[g])) for tables in block_ids]
            table = torch.tensor(rows, dtype=torch.long, device=device)  # [S, max_blocks], null-padded
            block_tables.append(table)
            blocks = table[seq_ids, torch.div(positions, bs, rounding_mode="floor")]  # [T]
            slot_mappings.append(blocks * bs + positions % bs)
        return cls(
            storage=storage,
            positions=positions,
            q_dest=q_dest,
            start=start,
            q_len=q_len,
            seq_len=start + q_len,
            q_max=q_max,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
        )

    def plan(self, group: int, attn: AttentionType) -> _GatherPlan:
        """The gather / mask of ``group`` under ``attn``, computed once per step."""
        key = (group, attn)
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        bs = self.storage.block_size
        device = self.positions.device
        k_first = attn.first_key(self.start)  # [S] first key any query of the sequence may see
        k_len = self.seq_len - k_first  # [S]
        k_max = int(k_len.max())
        j = torch.arange(k_max, device=device)  # [Kmax]
        k_valid = j.unsqueeze(0) < k_len.unsqueeze(1)  # [S, Kmax]
        # padded keys repeat the last real key of their sequence (a live slot) and are masked out
        k_pos = k_first.unsqueeze(1) + torch.minimum(j.unsqueeze(0), (k_len - 1).unsqueeze(1))  # [S, Kmax]
        table = self.block_tables[group]  # [S, max_blocks]
        k_blocks = table.gather(1, torch.div(k_pos, bs, rounding_mode="floor"))  # [S, Kmax]
        if bool((k_blocks == 0).any()):
            s, col = (k_blocks == 0).nonzero()[0].tolist()
            raise InvariantViolation(
                f"group {group} ({attn.kind}): sequence {s} needs key position {int(k_pos[s, col])}, "
                f"which its block table maps to the null block"
            )
        k_slots = (k_blocks * bs + k_pos % bs).reshape(-1)  # [S * Kmax]

        i = torch.arange(self.q_max, device=device)  # [Qmax]
        q_pos = self.start.unsqueeze(1) + i.unsqueeze(0)  # [S, Qmax]
        q_valid = i.unsqueeze(0) < self.q_len.unsqueeze(1)  # [S, Qmax]
        allowed = allowed_key_mask(attn, q_pos, k_pos) & k_valid.unsqueeze(1)  # [S, Qmax, Kmax]
        # padded query rows are discarded; let them see their first key so no row is all -inf
        allowed |= (~q_valid).unsqueeze(2) & (j == 0).view(1, 1, -1)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
        bias.masked_fill_(~allowed, float("-inf"))
        plan = _GatherPlan(k_slots=k_slots, bias=bias.view(self.num_seqs, 1, 1, self.q_max, k_max), k_max=k_max)
        self._plans[key] = plan
        return plan


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    attn: AttentionType,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V of ``layer``, then attend through its block tables.

    query: [T, Hq, D]; key / value: [T, Hkv, D]; sinks: [Hq] learned logits that join
    the softmax denominator (GPT-OSS); softcap: ``tanh(s / c) * c`` on the scores.
    Returns [T, Hq, D].
    """
    storage = meta.storage
    group = storage.group_of(layer)
    storage.write(layer, meta.slot_mappings[group], key, value)

    plan = meta.plan(group, attn)
    num_seqs, q_max, k_max = meta.num_seqs, meta.q_max, plan.k_max
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv = storage.num_kv_heads
    rep = num_heads // num_kv

    k_flat, v_flat = storage.flat_kv(layer)  # [num_slots, Hkv, D]
    k = k_flat.index_select(0, plan.k_slots).view(num_seqs, k_max, num_kv, head_size)  # [S, Kmax, Hkv, D]
    v = v_flat.index_select(0, plan.k_slots).view(num_seqs, k_max, num_kv, head_size)
    k = k.permute(0, 2, 1, 3).unsqueeze(2).to(query.dtype)  # [S, Hkv, 1, Kmax, D]
    v = v.permute(0, 2, 1, 3).unsqueeze(2).to(query.dtype)

    q = query.new_zeros(num_seqs * q_max, num_heads, head_size)  # [S * Qmax, Hq, D]
    q.index_copy_(0, meta.q_dest, query)
    # query head h reads KV head h // rep (HF repeat_kv order)
    q = q.view(num_seqs, q_max, num_kv, rep, head_size).permute(0, 2, 3, 1, 4)  # [S, Hkv, rep, Qmax, D]

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [S, Hkv, rep, Qmax, Kmax]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float() + plan.bias
    if sinks is not None:
        sink = sinks.float().view(1, num_kv, rep, 1, 1).expand(num_seqs, num_kv, rep, q_max, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v)  # [S, Hkv, rep, Qmax, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs * q_max, num_heads, head_size)  # [S * Qmax, Hq, D]
    return out.index_select(0, meta.q_dest)  # [T, Hq, D]
