"""Gated DeltaNet (the linear attention of Qwen3-Next / Qwen3.5) over a flat varlen batch,
with explicit per-sequence state held in slot-indexed pools.

Per layer and sequence the state (:class:`~hybridkv.engine.state.StateShape`, re-exported
here with the rest of :mod:`hybridkv.engine.state`) is ``conv`` [K - 1, conv_dim], the last
``K - 1`` inputs of the causal depthwise conv1d (``conv_dim = 2 * Hk * Dk + Hv * Dv``), in
the model's dtype, and ``ssm`` [Hv, Dk, Dv], the delta-rule memory ``S``, always float32
(it sums every token's update; bf16 would drift). Both live in per-layer pools
(:class:`StateStorage`) addressed by *slot*; a step's :class:`StateMetadata` says per
sequence which slot its state is read from (-1: the zero state of a fresh prefill) and
after how many tokens it is stored in which slot (:class:`StateWrite`). A layer gathers
every read state first and writes after, so a decode may update its slot in place.

The recurrence, per value head (``q``, ``k`` L2-normalised, ``q`` scaled by ``Dk**-0.5``;
``g = -exp(A_log) * softplus(a + dt_bias)`` <= 0, ``beta = sigmoid(b)``)::

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T    [Dk, Dv]
    o_t = S_t^T q_t                                                          [Dv]

Two forms compute it (HF's ``torch_recurrent_gated_delta_rule`` /
``torch_chunk_gated_delta_rule`` for the maths; the code is ours): decodes (``q_len == 1``)
take one recurrent step, batched; prefill segments take the chunked form (a WY/UT transform
inside each chunk of ``chunk_size`` tokens, a scan over chunks). A segment is cut at its
checkpoints and every piece padded to whole chunks with neutral tokens (``k = v = 0``,
``g = 0``, ``beta = 0``: no decay, no update), so a checkpoint is the scan's state at a
chunk boundary; all prefill segments run as one batch of such padded streams.

Worked example: sequence 0 decoding (state in slot 3, updated in place) and sequence 1
prefilling 10 fresh tokens, storing the state after 8 tokens in slot 5 (a block boundary
the prefix cache keeps) and after all 10 in slot 6::

    meta = StateMetadata.build(storage, query_lens=[1, 10], read_slots=[3, -1],
                               writes=[[(1, 3)], [(8, 5), (10, 6)]])

With ``chunk_size`` 4, sequence 1's stream is ``[t0..t3] [t4..t7] [t8 t9 pad pad]``; its
state after chunk 1 goes to slot 5, after chunk 2 to slot 6.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.host_tensors import long_tensor
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.state import StateMetadata, StateShape, StateStorage, StateWrite
from hybridkv.errors import InvalidConfigError

__all__ = [
    "StateShape",
    "StateStorage",
    "StateWrite",
    "StateMetadata",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "l2norm",
    "delta_rule_step",
    "chunked_delta_rule",
    "conv_windows",
]

#: the chunk length of the chunked form (HF's and FLA's default)
CHUNK_SIZE = 64


# ------------------------------------------------------------------------- maths
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and HF's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_windows(query_lens: Sequence[int], kernel: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Index tensors of the stateful causal conv over a flat batch.

    The conv reads an *extended* buffer: per sequence its ``K - 1`` state columns then
    its ``q_len`` inputs, sequences one after another. Returns ``windows`` [T, K] (token
    ``t``'s K inputs in that buffer, oldest first) and ``bases`` (each sequence's first
    row in it): the state after ``n`` of sequence ``s``'s tokens is rows
    ``bases[s] + n .. bases[s] + n + K - 2``.

    >>> w, b = conv_windows([2, 1], 3, torch.device("cpu"))
    >>> w.tolist(), b
    ([[0, 1, 2], [1, 2, 3], [4, 5, 6]], [0, 4])
    """
    bases, idx, base = [], [], 0
    for q in query_lens:
        bases.append(base)
        idx.extend(base + i for i in range(q))
        base += q + kernel - 1
    start = long_tensor(idx, device)  # [T]
    return start[:, None] + torch.arange(kernel, device=device), bases


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for a batch: q / k [B, H, Dk], v [B, H, Dv], g / beta [B, H],
    state [B, H, Dk, Dv] (fp32, all fp32) -> (out [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    saves: Sequence[tuple[int, int]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over padded streams (all fp32).

    q / k [B, H, L, Dk] (q already scaled), v [B, H, L, Dv], g / beta [B, H, L] with ``L`` a
    multiple of ``chunk_size``; state [B, H, Dk, Dv], the state before each stream.
    ``saves``: ``(chunk, b)`` pairs: keep stream ``b``'s state after chunk ``chunk``.
    Returns (out [B, H, L, Dv], the saved states [len(saves), H, Dk, Dv] in ``saves`` order).
    """
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n = length // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    cum = g.cumsum(-1)  # [B, H, N, C] log decay from the chunk start to each token
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [.., C, C] i >= j
    k_beta = k * beta[..., None]
    # (I + strictly_lower(k_beta k^T * decay)) [u | w] = [v * beta | k_beta * exp(cum)]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)  # [.., C, Dv + Dk]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    intra = (q @ k.transpose(-1, -2)) * decay  # [.., C, C]
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    by_chunk: dict[int, list[tuple[int, int]]] = {}
    for i, (chunk, row) in enumerate(saves):
        by_chunk.setdefault(chunk, []).append((i, row))
    saved: list[torch.Tensor | None] = [None] * len(saves)
    out = q.new_empty(b, h, n, c, dv)
    s = state
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # [B, H, C, Dv]
        out[:, :, i] = q_dec[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
        for j, row in by_chunk.get(i, ()):
            saved[j] = s[row]
    stacked = torch.stack(saved) if saved else state.new_empty(0, h, dk, dv)  # type: ignore[arg-type]
    return out.reshape(b, h, length, dv), stacked


def _read_states(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool [num_slots, ...] gathered at ``slots`` [n]; -1 gives zeros (a fresh sequence)."""
    got = pool.index_select(0, slots.clamp(min=0))
    fresh = (slots < 0).view(-1, *([1] * (pool.dim() - 1)))
    return got.masked_fill(fresh, 0)


# ------------------------------------------------------------------------- layer
class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * silu(z)`` (HF ``Qwen3NextRMSNormGated``: norm in fp32, gate after)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (HF ``Qwen3NextGatedDeltaNet``, ``split_projections``:
    ``Qwen3_5GatedDeltaNet``), parameters by HF's names.

    Qwen3-Next projects ``in_proj_qkvz`` (per key head: q, k, then its ``Hv/Hk`` value
    heads' v and z) and ``in_proj_ba`` (per key head: b, then a); Qwen3.5 has
    ``in_proj_qkv`` (q | k | v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
    """

    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        split_projections: bool = False,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise InvalidConfigError(
                f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads {num_k_heads}"
            )
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.split_projections = split_projections
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False,
                                padding=conv_kernel - 1)
        if split_projections:
            self.in_proj_qkv = Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = Linear(hidden, num_v_heads, bias=False)
            self.in_proj_a = Linear(hidden, num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(hidden, 2 * num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def state_shape(self) -> StateShape:
        return StateShape(self.conv_dim, self.conv_kernel, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        t = x.shape[0]
        if self.split_projections:
            z = self.in_proj_z(x).view(t, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        hk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // hk
        qkvz = self.in_proj_qkvz(x).view(t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, hk, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.num_v_heads, dv), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, state: StateMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] ([N, hidden] for the rows ``keep`` names); reads and
        writes this layer's state slots as ``state`` says."""
        storage = state.storage
        conv_pool, ssm_pool = storage.conv(self.layer_idx), storage.ssm(self.layer_idx)
        mixed, z, b, a = self.project(x)
        mixed = self._conv(mixed, state, conv_pool)  # [T, conv_dim], after silu
        t = x.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.num_v_heads // self.num_k_heads
        q = l2norm(q.reshape(t, self.num_k_heads, self.head_k_dim).float())
        k = l2norm(k.reshape(t, self.num_k_heads, self.head_k_dim).float())
        if r > 1:  # key head i serves value heads i*r .. i*r + r-1
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        q = q * self.head_k_dim**-0.5
        v = v.reshape(t, self.num_v_heads, self.head_v_dim).float()
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        reads = _read_states(ssm_pool, state.read_slot_tensor).float()  # [S, Hv, Dk, Dv]: all reads first
        out = q.new_empty(t, self.num_v_heads, self.head_v_dim)  # fp32
        new_states: dict[int, torch.Tensor] = {}  # write index -> state
        if state.decodes:
            self._decode(q, k, v, g, beta, reads, state, out, new_states)
        if state.prefills:
            self._prefill(q, k, v, g, beta, reads, state, out, new_states)
        ssm_pool.index_copy_(0, state.write_slot_tensor,
                             torch.stack([new_states[i] for i in range(len(new_states))]).to(ssm_pool.dtype))
        if keep is not None:
            out, z = out.index_select(0, keep), z.index_select(0, keep)
        y = self.norm(out.to(x.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(y.view(out.shape[0], self.value_dim))

    # ------------------------------------------------------------- pieces
    def _conv(self, mixed: torch.Tensor, state: StateMetadata, pool: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv + silu with state; writes the conv checkpoints."""
        k1 = self.conv_kernel - 1
        windows, bases = state.memo(("conv", self.conv_kernel),
                                    lambda: conv_windows(state.query_lens, self.conv_kernel, state.storage.device))
        prior = _read_states(pool, state.read_slot_tensor)  # [S, K-1, C]
        parts = []
        for s, q in enumerate(state.query_lens):
            parts.append(prior[s])  # [K-1, C]
            parts.append(mixed[state.cu_starts[s] : state.cu_starts[s] + q])
        ext = torch.cat(parts).to(self.conv1d.weight.dtype)  # [T + S (K-1), C]
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)  # [C, K]
        out = torch.einsum("tkc,ck->tc", ext[windows], weight)
        ends = state.memo(("conv_ends", self.conv_kernel), lambda: long_tensor(
            [bases[s] + w.tokens + i for s, ws in enumerate(state.writes) for w in ws for i in range(k1)],
            state.storage.device))
        saved = ext.index_select(0, ends).view(-1, k1, self.conv_dim)  # [W, K-1, C]
        pool.index_copy_(0, state.write_slot_tensor, saved.to(pool.dtype))
        return F.silu(out).to(mixed.dtype)

    def _decode(self, q, k, v, g, beta, reads, state: StateMetadata, out, new_states) -> None:
        """Every one-token sequence in one recurrent step."""
        rows, seqs, write_index = state.memo("decode", lambda: _decode_index(state))
        o, s = delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], reads.index_select(0, seqs))
        out.index_copy_(0, rows, o)
        for j, w in enumerate(write_index):
            new_states[w] = s[j]

    def _prefill(self, q, k, v, g, beta, reads, state: StateMetadata, out, new_states) -> None:
        """Every longer segment as one batch of padded streams (see the module docstring)."""
        plan = state.memo(("prefill", self.chunk_size), lambda: _PrefillPlan.make(state, self.chunk_size))
        pad = plan.src  # [B, L] flat row or T (a zero row)

        def stream(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [B, H, L, ...]
            x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
            y = x.index_select(0, pad.reshape(-1)).view(*pad.shape, *x.shape[1:])
            return y.transpose(1, 2).contiguous()

        o, saved = chunked_delta_rule(
            stream(q), stream(k), stream(v), stream(g), stream(beta), reads.index_select(0, plan.seq_index),
            self.chunk_size, plan.saves,
        )
        o = o.transpose(1, 2).reshape(-1, self.num_v_heads, self.head_v_dim)  # [B * L, Hv, Dv]
        out.index_copy_(0, plan.dst_rows, o.index_select(0, plan.src_positions))
        for j, w in enumerate(plan.write_index):
            new_states[w] = saved[j]


def _decode_index(state: StateMetadata) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(flat rows of the decode tokens, their sequences, each one's write index)."""
    first_write = list(itertools.accumulate((len(ws) for ws in state.writes), initial=0))
    device = state.storage.device
    rows = long_tensor([state.cu_starts[s] for s in state.decodes], device)
    return rows, long_tensor(list(state.decodes), device), [first_write[s] for s in state.decodes]


@dataclass(frozen=True, slots=True)
class _PrefillPlan:
    """Where each prefill token sits in the padded streams, and which chunk ends are checkpoints."""

    src: torch.Tensor  # [B, L]: the flat row of each stream position (T: padding)
    seq_index: torch.Tensor  # [B]: the sequence of each stream
    dst_rows: torch.Tensor  # [n]: flat rows of the prefill tokens
    src_positions: torch.Tensor  # [n]: their positions in the flattened [B * L] streams
    saves: tuple[tuple[int, int], ...]  # (chunk, stream) per checkpoint
    write_index: tuple[int, ...]  # the write index (across the step) of each save

    @classmethod
    def make(cls, state: StateMetadata, chunk: int) -> "_PrefillPlan":
        total = state.num_tokens
        write_base = list(itertools.accumulate((len(ws) for ws in state.writes), initial=0))
        streams: list[list[int]] = []
        saves, write_index = [], []
        for b, s in enumerate(state.prefills):
            row0, src, prev = state.cu_starts[s], [], 0
            for j, w in enumerate(state.writes[s]):
                piece = list(range(row0 + prev, row0 + w.tokens))
                src.extend(piece)
                src.extend([total] * (-len(piece) % chunk))
                saves.append((len(src) // chunk - 1, b))
                write_index.append(write_base[s] + j)
                prev = w.tokens
            streams.append(src)
        length = max(len(x) for x in streams)
        flat = [p for x in streams for p in x + [total] * (length - len(x))]
        positions = [i for i, p in enumerate(flat) if p != total]
        device = state.storage.device
        return cls(
            src=long_tensor(flat, device).view(len(streams), length),
            seq_index=long_tensor(list(state.prefills), device),
            dst_rows=long_tensor([flat[i] for i in positions], device),
            src_positions=long_tensor(positions, device),
            saves=tuple(saves),
            write_index=tuple(write_index),
        )
