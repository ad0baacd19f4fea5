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

Per attention type the step's queries are cut into segments and batched into a few
padded buckets (:mod:`hybridkv.engine.attention_plan`): all single-query segments
(decodes) in one, prefill segments grouped by shape. A bucket is one gather of K and
V (one ``index_select`` over slots, all heads), then either a hand-written kernel
(``baddbmm`` + softmax + ``bmm``; decodes, learned sinks, soft-capping) or
``scaled_dot_product_attention`` (prefill buckets, ``is_causal`` when the segments
read only their own keys). Layouts are built once per step and attention type, key
slots once per step and group. With ``storage.debug`` a needed key that the block
table maps to the null block raises :class:`InvariantViolation`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from hybridkv.engine.attention_plan import Bucket, Layout, build_layout, visible_keys
from hybridkv.engine.host import long_tensor
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.errors import InvalidArgumentError, InvalidConfigError

__all__ = ["AttentionType", "FULL", "AttentionMetadata", "paged_attention", "reference_paged_attention",
           "allowed_key_mask", "padded_tables"]


@dataclass(frozen=True, slots=True)
class AttentionType:
    """``kind`` is ``"full"``, ``"sliding"`` (``size`` = window) or ``"chunked"`` (``size`` = chunk);
    ``"linear"`` (the planner's ``LINEAR_KIND``) names a Gated DeltaNet layer, which has no KV and never runs
    :func:`paged_attention` (see :mod:`hybridkv.engine.models.gated_deltanet`)."""

    kind: str
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind in ("full", "linear"):
            if self.size is not None:
                raise InvalidConfigError(f"{self.kind} attention takes no window/chunk size")
        elif self.kind in ("sliding", "chunked"):
            if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
                raise InvalidConfigError(f"{self.kind} attention needs a positive int size, got {self.size!r}")
        else:
            raise InvalidConfigError(
                f"unknown attention kind {self.kind!r}; expected full, sliding, chunked or linear"
            )

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
    return visible_keys(attn.kind, attn.size, q_pos, k_pos)


def padded_tables(block_ids: Sequence[Sequence[Sequence[int]]]) -> tuple[list[int], int]:
    """Every sequence's group tables flattened ``[S, G, W]``, null-padded to the widest (``W``).

    >>> padded_tables([[[3, 4], [5]], [[6], [7, 8, 9]]])
    ([3, 4, 0, 5, 0, 0, 6, 0, 0, 7, 8, 9], 3)
    """
    width = max(len(t) for tables in block_ids for t in tables)
    flat: list[int] = []
    for tables in block_ids:
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
    return flat, width


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers of one step read, built once per step.

    Use :meth:`build`. Tensors: ``positions`` [T]; ``start`` / ``q_len`` / ``seq_len``
    [S]; ``block_tables[g]`` [S, max_blocks_g] (padded with the null block, which is
    never read); ``slot_mappings[g]`` [T]. ``starts`` / ``query_lens``: the same as
    Python ints (the layouts are planned from them). ``output_seqs``: the sequences
    whose last token's output the step needs (None: every token's).
    """

    storage: PagedKVStorage
    positions: torch.Tensor
    start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    starts: list[int]
    query_lens: list[int]
    block_tables: list[torch.Tensor]
    slot_mappings: list[torch.Tensor]
    output_seqs: list[int] | None = None
    #: "reference" (this module), "triton" (hybridkv.engine.attention_triton) or "cpu" (hybridkv.engine.attention_cpu)
    backend: str = "reference"
    #: a CUDA-graph decode step: no sequence has more keys than this (its splits are fixed by it, not by the step)
    decode_key_bound: int | None = None
    block_ids: Sequence[Sequence[Sequence[int]]] | None = None  # the tables as given (cascade reads them)
    #: ints -> an int64 tensor on the device (None: :func:`long_tensor`); use :meth:`ints`
    upload: Callable[[Sequence[int]], torch.Tensor] | None = None
    _memo: dict[Any, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

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
        output_seqs: Sequence[int] | None = None,
        backend: str = "reference",
        upload: Callable[[Sequence[int]], torch.Tensor] | None = None,
    ) -> "AttentionMetadata":
        """Metadata for ``S`` sequences; ``block_ids[s][g]`` is sequence ``s``'s group-``g`` table.

        output_seqs: sequence indices whose last token's output is wanted (the model then
        runs its last layer's attention queries and MLP for those rows only).
        upload: how ints reach the device (default :func:`~hybridkv.engine.host.long_tensor`).
        """
        device = storage.device
        bs = storage.block_size
        num_seqs = len(num_computed)
        if len(query_lens) != num_seqs or len(block_ids) != num_seqs:
            raise InvalidArgumentError("num_computed, query_lens and block_ids must have one entry per sequence")
        if num_seqs == 0:
            raise InvalidArgumentError("a step needs at least one sequence")
        if output_seqs is not None and any(not 0 <= s < num_seqs for s in output_seqs):
            raise InvalidArgumentError(f"output_seqs must index the {num_seqs} sequences, got {list(output_seqs)}")
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

        starts, lens = [int(n) for n in num_computed], [int(q) for q in query_lens]
        ints = upload if upload is not None else (lambda values: long_tensor(values, device))
        start = ints(starts)  # [S]
        q_len = ints(lens)  # [S]
        if max(lens) == 1:  # a pure decode step: one token per sequence
            seq_ids = torch.arange(num_seqs, device=device)  # [T = S]
            positions = start
        else:
            total = sum(lens)  # given, so that no size is read back from the device
            seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_len, output_size=total)  # [T]
            cu = torch.cumsum(q_len, 0) - q_len  # [S] first flat token of each sequence
            offset = torch.arange(total, device=device) - cu[seq_ids]  # [T] index within the sequence
            positions = start[seq_ids] + offset  # [T]

        num_groups = storage.num_groups
        flat, width = padded_tables(block_ids)
        tables_sgw = ints(flat).view(num_seqs, num_groups, width)  # [S, G, W]
        slots = tables_sgw.permute(1, 0, 2)[:, seq_ids, torch.div(positions, bs, rounding_mode="floor")]  # [G, T]
        slots = slots * bs + positions % bs
        return cls(
            storage=storage,
            positions=positions,
            start=start,
            q_len=q_len,
            seq_len=start + q_len,
            starts=starts,
            query_lens=lens,
            block_tables=[tables_sgw[:, g] for g in range(num_groups)],  # [S, W] views
            slot_mappings=list(slots.unbind(0)),  # [T] each
            output_seqs=None if output_seqs is None else [int(s) for s in output_seqs],
            backend=backend,
            block_ids=block_ids,
            upload=upload,
        )

    def ints(self, values: Sequence[int]) -> torch.Tensor:
        """int64 tensor [n] of ``values`` on the step's device, through ``upload`` when given
        (a CUDA runner's pinned stager: no host synchronisation)."""
        if self.upload is not None:
            return self.upload(values)
        return long_tensor(values, self.positions.device)

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` once per step under ``key`` (per-step tensors every layer reuses)."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = make()
            return value

    def is_decode(self) -> bool:
        """Every sequence has one query token this step (a decode step)."""
        return self.memo("is_decode", lambda: max(self.query_lens) == 1)

    def output_rows(self) -> torch.Tensor | None:
        """[N] flat index of the last token of each of ``output_seqs``; None: all T rows, in order."""

        def make() -> torch.Tensor | None:
            seqs = self.output_seqs
            if seqs is None or (len(seqs) == self.num_tokens and seqs == list(range(self.num_seqs))):
                return None
            ends = list(itertools.accumulate(self.query_lens))
            return self.ints([ends[s] - 1 for s in seqs])

        return self.memo("output_rows", make)

    def layout(self, attn: AttentionType, outputs_only: bool = False) -> Layout:
        """The segments / buckets of ``attn`` this step (shared by all groups of that type).

        outputs_only: one query per ``output_seqs`` entry (its last token), in that order.
        """

        def make() -> Layout:
            bs, device = self.storage.block_size, self.positions.device
            if not outputs_only:
                return build_layout(attn.kind, attn.size, self.starts, self.query_lens, bs, device)
            seqs = self.output_seqs or []
            ends = [self.starts[s] + self.query_lens[s] - 1 for s in seqs]
            return build_layout(attn.kind, attn.size, ends, [1] * len(seqs), bs, device, seqs=seqs)

        return self.memo(("layout", attn, outputs_only), make)

    def key_slots(self, group: int, attn: AttentionType, outputs_only: bool = False) -> list[torch.Tensor]:
        """Per bucket of :meth:`layout`, the slots of its padded keys [B * K] in ``group``."""
        storage = self.storage
        return self.memo(
            ("slots", group, attn, outputs_only),
            lambda: self.layout(attn, outputs_only).key_slots(
                self.block_tables[group], storage.block_size, storage.debug, group
            ),
        )


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
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V of ``layer``, then attend through its block tables.

    query: [T, Hq, D]; key / value: [T, Hkv, D] (any strides with a unit last dim);
    sinks: [Hq] learned logits that join the softmax denominator (GPT-OSS); softcap:
    ``tanh(s / c) * c`` on the scores; keep: ``meta.output_rows()`` to attend only
    from those rows (K/V of all T tokens are still written). Returns [T, Hq, D]
    ([N, Hq, D] with ``keep``).
    """
    if meta.backend == "triton":
        from hybridkv.engine.attention_triton import triton_paged_attention

        return triton_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep)
    if meta.backend == "cpu":
        from hybridkv.engine.attention_cpu import cpu_paged_attention

        return cpu_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep)
    return reference_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep)


def reference_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    attn: AttentionType,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` in torch ops (this module's buckets), whatever ``meta.backend``."""
    storage = meta.storage
    group = storage.group_of(layer)
    storage.write(layer, meta.slot_mappings[group], key, value)
    outputs_only = keep is not None
    if outputs_only:
        query = query.index_select(0, keep)  # [N, Hq, D]
    layout = meta.layout(attn, outputs_only)
    slots = meta.key_slots(group, attn, outputs_only)
    manual = sinks is not None or softcap is not None
    results = []
    for bucket, k_slots in zip(layout.buckets, slots):
        q = query if bucket.q_rows is None else query.index_select(0, bucket.q_rows)  # [B * Q, Hq, D]
        kv = storage.gather(layer, k_slots, scratch=True)  # [2 Hkv, B * K, D], used before the next gather
        if manual or (bucket.q == 1 and bucket.num > 1):  # batched decodes: a padded key mask
            out = _attend_manual(q, kv, bucket, scale, sinks, softcap)
        else:  # prefill buckets, and one decode (which sees every key it gathered: no mask)
            out = _attend_sdpa(q, kv, bucket, scale)
        results.append(out if bucket.out_rows is None else out.index_select(0, bucket.out_rows))  # [n, Hq, D]
    if layout.in_order:
        return results[0]
    merged = query.new_empty(query.shape)  # [T, Hq, D]
    for bucket, out in zip(layout.buckets, results):
        merged.index_copy_(0, bucket.tokens, out)
    return merged


def _attend_manual(
    q: torch.Tensor,
    kv: torch.Tensor,
    bucket: Bucket,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [B * Q, Hq, D], kv [2 Hkv, B * K, D] -> [B * Q, Hq, D]; batched over (KV head, segment)."""
    num, q_len, k_len = bucket.num, bucket.q, bucket.k
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv = kv.shape[0] // 2
    rep = num_heads // num_kv
    dtype = q.dtype
    if kv.dtype != torch.float32 or dtype != torch.float32:  # scores and softmax in fp32
        q, kv = q.float(), kv.float()
    # query head h reads KV head h // rep (HF repeat_kv order)
    q3 = q.view(num, q_len, num_kv, rep, head_size).permute(2, 0, 3, 1, 4)  # [Hkv, B, rep, Q, D]
    q3 = q3.reshape(num_kv * num, rep * q_len, head_size)
    k = kv[:num_kv].view(num_kv * num, k_len, head_size)  # [Hkv * B, K, D]
    v = kv[num_kv:].view(num_kv * num, k_len, head_size)
    bias = bucket.bias_by_kv_head(num_kv, rep)  # [Hkv * B, rep * Q, K]
    if softcap is None:
        scores = torch.baddbmm(bias, q3, k.transpose(1, 2), alpha=scale)  # [Hkv * B, rep * Q, K]
    else:
        scores = torch.bmm(q3, k.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap + bias
    if sinks is not None:
        sink = sinks.float().view(num_kv, 1, rep, 1, 1).expand(num_kv, num, rep, q_len, 1)
        scores = torch.cat([scores, sink.reshape(num_kv * num, rep * q_len, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v)  # [Hkv * B, rep * Q, D]
    out = out.view(num_kv, num, rep, q_len, head_size).permute(1, 3, 0, 2, 4)  # [B, Q, Hkv, rep, D]
    out = out.reshape(num * q_len, num_heads, head_size)
    return out if out.dtype == dtype else out.to(dtype)


def _attend_sdpa(q: torch.Tensor, kv: torch.Tensor, bucket: Bucket, scale: float) -> torch.Tensor:
    """q [B * Q, Hq, D], kv [2 Hkv, B * K, D] -> [B * Q, Hq, D] with torch's fused attention."""
    num, q_len, k_len = bucket.num, bucket.q, bucket.k
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv = kv.shape[0] // 2
    lone = num == 1 and q_len == 1  # one decode query: every gathered key is visible
    kv = kv.to(q.dtype).view(2, num_kv, num, k_len, head_size).transpose(1, 2)  # [2, B, Hkv, K, D]
    q4 = q.view(num, q_len, num_heads, head_size).transpose(1, 2)  # [B, Hq, Q, D]
    out = F.scaled_dot_product_attention(
        q4,
        kv[0],
        kv[1],
        attn_mask=None if bucket.causal or lone else bucket.bias().to(q.dtype),
        is_causal=bucket.causal and not lone,
        scale=scale,
        enable_gqa=num_heads != num_kv,
    )  # [B, Hq, Q, D]
    return out.transpose(1, 2).reshape(num * q_len, num_heads, head_size)
