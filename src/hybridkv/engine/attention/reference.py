"""The ``reference`` attention backend: paged attention in torch ops, any device, every case.

Per attention type the step's queries are cut into segments and batched into a few padded
buckets (:mod:`hybridkv.engine.attention.plan`): all single-query segments (decodes) in one,
prefill segments grouped by shape. A bucket is one gather of K and V (one ``index_select``
over slots, all heads), then either a hand-written kernel (``baddbmm`` + softmax + ``bmm``;
decodes, learned sinks, soft-capping) or ``scaled_dot_product_attention`` (prefill buckets,
``is_causal`` when the segments read only their own keys). The step state
(:class:`ReferenceState`) builds the layouts once per step and attention type, and the key
slots once per step and group. With ``storage.debug`` a needed key that the block table maps
to the null block raises :class:`~hybridkv.errors.InvariantViolation`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.attention.backend import AttentionBackend
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.plan import Bucket, Layout, build_layout
from hybridkv.engine.attention.types import AttentionType

__all__ = ["ReferenceBackend", "ReferenceState", "reference_paged_attention"]


class ReferenceState:
    """The reference backend's step state: layouts per (attention type, outputs only) and key
    slots per (group, attention type, outputs only), each made on first use."""

    __slots__ = ("meta", "_layouts", "_slots")

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._layouts: dict[Any, Layout] = {}
        self._slots: dict[Any, list[torch.Tensor]] = {}

    def layout(self, attn: AttentionType, outputs_only: bool = False) -> Layout:
        """The segments / buckets of ``attn`` this step (shared by all groups of that type).

        outputs_only: one query per ``output_seqs`` entry (its last token), in that order.
        """
        key = (attn, outputs_only)
        if key not in self._layouts:
            meta = self.meta
            bs, device = meta.storage.block_size, meta.positions.device
            if not outputs_only:
                layout = build_layout(attn.kind, attn.size, meta.starts, meta.query_lens, bs, device)
            else:
                seqs = meta.output_seqs or []
                ends = [meta.starts[s] + meta.query_lens[s] - 1 for s in seqs]
                firsts = meta.first_rows()
                layout = build_layout(attn.kind, attn.size, ends, [1] * len(seqs), bs, device, seqs=seqs,
                                      new_from=[meta.starts[s] for s in seqs], new_tok=[firsts[s] for s in seqs])
            self._layouts[key] = layout
        return self._layouts[key]

    def key_slots(self, group: int, attn: AttentionType, outputs_only: bool = False) -> list[torch.Tensor]:
        """Per bucket of :meth:`layout`, the slots of its padded keys [B * K] in ``group``."""
        key = (group, attn, outputs_only)
        if key not in self._slots:
            storage = self.meta.storage
            self._slots[key] = self.layout(attn, outputs_only).key_slots(
                self.meta.block_tables[group], storage.block_size, storage.debug, group,
                fresh=group in self.meta.gap_groups,
            )
        return self._slots[key]


class ReferenceBackend(AttentionBackend):
    """Torch ops on any device: the exact path, and the fallback of the other backends."""

    name = "reference"

    def new_state(self, meta: AttentionMetadata) -> ReferenceState:
        return ReferenceState(meta)

    def forward(
        self,
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
        return reference_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep,
                                         state=meta.state)


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
    state: ReferenceState | None = None,
) -> torch.Tensor:
    """:meth:`AttentionBackend.forward` in torch ops (this module's buckets), whatever ``meta.backend``;
    ``state`` keeps the step's layouts (a backend that falls back here passes its own)."""
    if state is None:
        state = ReferenceState(meta)
    storage = meta.storage
    group = storage.group_of(layer)
    gap = group in meta.gap_groups
    if gap:  # a tail_only gap: store the tokens that get slots; attend to the step's own keys from here
        rows, slots = meta.stored(group)
        storage.write(layer, slots, key.index_select(0, rows), value.index_select(0, rows))
        step_kv = torch.cat([key, value], 1).transpose(0, 1).to(storage.dtype)  # [2 Hkv, T, D], as stored
    else:
        storage.write(layer, meta.slot_mappings[group], key, value)
    outputs_only = keep is not None
    if outputs_only:
        query = query.index_select(0, keep)  # [N, Hq, D]
    layout = state.layout(attn, outputs_only)
    slots = state.key_slots(group, attn, outputs_only)
    manual = sinks is not None or softcap is not None
    results = []
    for bucket, k_slots in zip(layout.buckets, slots):
        q = query if bucket.q_rows is None else query.index_select(0, bucket.q_rows)  # [B * Q, Hq, D]
        kv = storage.gather(layer, k_slots, scratch=True)  # [2 Hkv, B * K, D], used before the next gather
        if gap:
            dest, src = bucket.fresh_keys()
            kv.index_copy_(1, dest, step_kv.index_select(1, src))
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
