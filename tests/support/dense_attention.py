"""A dense fp64 attention reference for the kernel tests (masks spelled out per query)."""

from __future__ import annotations

import torch


def first_key(kind, size, p):
    if kind == "sliding":
        return max(0, p - size + 1)
    if kind == "chunked":
        return p // size * size
    return 0


def dense(q, k, v, positions, kind, size, scale, sinks=None, softcap=None):
    """q [Tq, Hq, D] at ``positions``; k / v [L, Hkv, D] for positions 0..L-1; fp64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1).permute(1, 0, 2)  # [Hq, L, D]
    v = v.repeat_interleave(rep, 1).permute(1, 0, 2)
    s = torch.einsum("thd,hld->htl", q, k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    kp = torch.arange(k.shape[1])
    mask = torch.stack([(kp <= p) & (kp >= first_key(kind, size, int(p))) for p in positions])  # [Tq, L]
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, s.shape[1], 1)], -1)
        p = torch.softmax(s, -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("htl,hld->thd", p, v)
