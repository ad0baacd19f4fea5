"""Gated DeltaNet kernels and layer: the chunked form against the recurrent one, checkpoints
through slots against one pass, the stateful conv against a plain conv, a flat batch against
each sequence alone, and the maths against transformers' torch reference functions."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.layers.gated_deltanet import (
    GatedDeltaNet,
    StateMetadata,
    StateStorage,
    chunked_delta_rule,
    delta_rule_step,
    l2norm,
)
from hybridkv.errors import InvalidArgumentError

SEEDS = range(6)


def _random_inputs(gen, b, h, length, dk, dv):
    q = l2norm(torch.randn(b, h, length, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(b, h, length, dk, generator=gen))
    v = torch.randn(b, h, length, dv, generator=gen)
    g = -torch.rand(b, h, length, generator=gen) * 2.0
    beta = torch.rand(b, h, length, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _recurrent(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[2]):
        o, state = delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
        outs.append(o)
    return torch.stack(outs, dim=2), state


@pytest.mark.parametrize("seed", SEEDS)
def test_chunked_form_equals_recurrent_form(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    chunk = rng.choice([2, 4, 8])
    b, h, dk, dv = rng.randint(1, 3), rng.randint(1, 3), rng.choice([4, 8]), rng.choice([3, 8])
    length = chunk * rng.randint(1, 5)
    q, k, v, g, beta, state = _random_inputs(gen, b, h, length, dk, dv)
    saves = [(i, row) for i in range(length // chunk) for row in range(b)]
    out, saved = chunked_delta_rule(q, k, v, g, beta, state, chunk, saves)
    want, _ = _recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    for (i, row), got in zip(saves, saved):  # the state after each chunk = the recurrence's there
        _, s = _recurrent(*(x[row : row + 1, :, : (i + 1) * chunk] for x in (q, k, v, g, beta)), state[row : row + 1])
        torch.testing.assert_close(got, s[0], atol=2e-5, rtol=1e-4)


def test_kernels_match_transformers_reference():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    gen = torch.Generator().manual_seed(7)
    b, t, hk, hv, dk, dv = 2, 37, 2, 4, 8, 6
    q, k = torch.randn(b, t, hk, dk, generator=gen), torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g, beta = -torch.rand(b, t, hv, generator=gen) * 3, torch.rand(b, t, hv, generator=gen)
    init = torch.randn(b, hv, dk, dv, generator=gen)
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, chunk_size=16, initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    # ours: normalise, expand key heads, scale q, pad to whole chunks with neutral tokens
    qq = (l2norm(q).repeat_interleave(hv // hk, dim=2) * dk**-0.5).transpose(1, 2)
    kk = l2norm(k).repeat_interleave(hv // hk, dim=2).transpose(1, 2)
    pad = -t % 8
    padded = [F.pad(x, (0, 0, 0, pad)) for x in (qq, kk, v.transpose(1, 2))]
    gg, bb = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))
    out, saved = chunked_delta_rule(*padded, gg, bb, init, 8, [((t + pad) // 8 - 1, 0), ((t + pad) // 8 - 1, 1)])
    torch.testing.assert_close(out.transpose(1, 2)[:, :t], want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(saved, want_state, atol=2e-5, rtol=1e-4)
    # one recurrent step = HF's recurrent form for one token
    want1, want1_state = hf.torch_recurrent_gated_delta_rule(
        q[:, :1], k[:, :1], v[:, :1], g=g[:, :1], beta=beta[:, :1], initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o1, s1 = delta_rule_step(qq[:, :, 0], kk[:, :, 0], v[:, 0], g[:, 0], beta[:, 0], init)
    torch.testing.assert_close(o1, want1[:, 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s1, want1_state, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------- the layer
def _layer(seed: int, chunk: int, split: bool = False) -> GatedDeltaNet:
    rng = random.Random(seed)
    hk = rng.choice([1, 2])
    layer = GatedDeltaNet(
        layer_idx=3, hidden=16, num_k_heads=hk, num_v_heads=hk * rng.choice([1, 2]), head_k_dim=rng.choice([4, 8]),
        head_v_dim=rng.choice([4, 6]), conv_kernel=rng.choice([2, 3, 4]), eps=1e-6, split_projections=split,
        chunk_size=chunk,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=gen).log())
            elif p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer.eval().requires_grad_(False)


def _storage(layer: GatedDeltaNet, slots: int = 32) -> StateStorage:
    return StateStorage([layer.layer_idx], slots, layer.state_shape())


def _run(layer, storage, x, query_lens, reads, writes):
    return layer(x, StateMetadata.build(storage, query_lens, reads, writes))


def _one_pass(layer, x):
    storage = _storage(layer)
    return _run(layer, storage, x, [x.shape[0]], [-1], [[(x.shape[0], 0)]]), storage


@pytest.mark.parametrize("seed", SEEDS)
def test_prefill_equals_token_by_token_decode(seed):
    layer = _layer(seed, chunk=4)
    gen = torch.Generator().manual_seed(100 + seed)
    length = 5 + seed * 3
    x = torch.randn(length, 16, generator=gen)
    want, full_storage = _one_pass(layer, x)
    storage = _storage(layer)
    outs = [_run(layer, storage, x[:1], [1], [-1], [[(1, 7)]])]
    for t in range(1, length):  # decode reads and writes slot 7 in place
        outs.append(_run(layer, storage, x[t : t + 1], [1], [7], [[(1, 7)]]))
    torch.testing.assert_close(torch.cat(outs), want, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(storage.ssm(3)[7], full_storage.ssm(3)[0], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(storage.conv(3)[7], full_storage.conv(3)[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_checkpoints_through_slots_equal_one_pass(seed):
    rng = random.Random(seed)
    layer = _layer(seed, chunk=rng.choice([2, 4, 8]))
    length = rng.randint(6, 30)
    x = torch.randn(length, 16, generator=torch.Generator().manual_seed(seed))
    want, _ = _one_pass(layer, x)
    storage = _storage(layer)
    # a first step over a prefix with checkpoints at random positions, then resume from each
    first = rng.randint(2, length - 1)
    cuts = sorted(rng.sample(range(1, first), k=min(3, first - 1))) + [first]
    writes = [(n, 10 + i) for i, n in enumerate(cuts)]
    got = _run(layer, storage, x[:first], [first], [-1], [writes])
    torch.testing.assert_close(got, want[:first], atol=5e-5, rtol=1e-4)
    for n, slot in writes:  # each checkpoint continues to the same outputs as the one pass
        rest = x[n:]
        pieces = sorted(rng.sample(range(1, len(rest)), k=min(2, len(rest) - 1))) + [len(rest)]
        out = _run(layer, storage, rest, [len(rest)], [slot], [[(p, 20 + i) for i, p in enumerate(pieces)]])
        torch.testing.assert_close(out, want[n:], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_stateful_conv_equals_conv_over_whole_sequence(seed):
    rng = random.Random(seed)
    layer = _layer(seed, chunk=4)
    c, kernel = layer.conv_dim, layer.conv_kernel
    length = rng.randint(3, 20)
    mixed = torch.randn(length, c, generator=torch.Generator().manual_seed(seed))
    # HF causal_conv1d_fn: left zero padding, then silu
    want = F.silu(F.conv1d(mixed.t()[None], layer.conv1d.weight, padding=kernel - 1, groups=c)[0, :, :length].t())
    storage = _storage(layer)
    cut = rng.randint(1, length - 1)
    a = layer._conv(mixed[:cut], StateMetadata.build(storage, [cut], [-1], [[(cut, 4)]]), storage.conv(3))
    b = layer._conv(mixed[cut:], StateMetadata.build(storage, [length - cut], [4], [[(length - cut, 4)]]),
                    storage.conv(3))
    torch.testing.assert_close(torch.cat([a, b]), want, atol=1e-5, rtol=1e-5)
    # the state is the last K-1 inputs (zeros before the first token)
    tail = torch.cat([torch.zeros(kernel - 1, c), mixed])[-(kernel - 1):]
    torch.testing.assert_close(storage.conv(3)[4], tail)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("split", [False, True])
def test_flat_batch_equals_each_sequence_alone(seed, split):
    rng = random.Random(seed)
    layer = _layer(seed, chunk=rng.choice([2, 4]), split=split)
    gen = torch.Generator().manual_seed(seed)
    # per sequence: a history already in a slot (or none), then this step's tokens
    seqs = []
    for s in range(rng.randint(2, 5)):
        history = rng.choice([0, 0, rng.randint(1, 9)])
        q_len = rng.choice([1, 1, rng.randint(2, 12)])
        seqs.append((torch.randn(history + q_len, 16, generator=gen), history, q_len))
    storage = _storage(layer, slots=64)
    alone, reads, writes, step_x = [], [], [], []
    for s, (x, history, q_len) in enumerate(seqs):
        own = _storage(layer)
        if history:  # the same history in both storages: slot s of the batch, slot 0 of its own
            _run(layer, storage, x[:history], [history], [-1], [[(history, s)]])
            _run(layer, own, x[:history], [history], [-1], [[(history, 0)]])
        cuts = sorted(rng.sample(range(1, q_len), k=min(2, q_len - 1))) + [q_len] if q_len > 1 else [1]
        slot_base = 20 + 8 * s
        alone.append(_run(layer, own, x[history:], [q_len], [0 if history else -1],
                          [[(n, 1 + i) for i, n in enumerate(cuts)]]))
        reads.append(s if history else -1)
        # a decode updates its slot in place; the others write fresh slots
        writes.append([(1, s)] if q_len == 1 and history else [(n, slot_base + i) for i, n in enumerate(cuts)])
        step_x.append(x[history:])
    got = _run(layer, storage, torch.cat(step_x), [q for _, _, q in seqs], reads, writes)
    torch.testing.assert_close(got, torch.cat(alone), atol=5e-5, rtol=1e-4)
    keep = torch.tensor([0, got.shape[0] - 1])
    storage2 = _storage(layer, slots=64)
    for s, (x, history, _) in enumerate(seqs):
        if history:
            _run(layer, storage2, x[:history], [history], [-1], [[(history, s)]])
    kept = layer(torch.cat(step_x), StateMetadata.build(storage2, [q for _, _, q in seqs], reads, writes), keep=keep)
    torch.testing.assert_close(kept, got[keep], atol=1e-6, rtol=1e-6)


def test_metadata_checks():
    layer = _layer(0, chunk=4)
    storage = _storage(layer, slots=8)
    with pytest.raises(InvalidArgumentError, match="last write"):
        StateMetadata.build(storage, [3], [-1], [[(2, 1)]])
    with pytest.raises(InvalidArgumentError, match="increase"):
        StateMetadata.build(storage, [3], [-1], [[(2, 1), (2, 2), (3, 3)]])
    with pytest.raises(InvalidArgumentError, match="written twice"):
        StateMetadata.build(storage, [3, 1], [-1, -1], [[(3, 1)], [(1, 1)]])
    with pytest.raises(InvalidArgumentError, match="read slot"):
        StateMetadata.build(storage, [1], [8], [[(1, 1)]])
    meta = StateMetadata.build(storage, [1, 4, 1], [2, -1, 5], [[(1, 2)], [(2, 0), (4, 1)], [(1, 5)]])
    assert (meta.decodes, meta.prefills, meta.cu_starts, meta.num_tokens) == ((0, 2), (1,), (0, 1, 5), 6)


def test_bf16_state_pools():
    """Pools may hold bf16 (the core's example sizes bf16 states); the maths stays fp32."""
    layer = _layer(2, chunk=4)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(5))
    want, _ = _one_pass(layer, x)
    storage = StateStorage([3], 8, layer.state_shape(), dtype=torch.bfloat16, ssm_dtype=torch.bfloat16)
    first = _run(layer, storage, x[:5], [5], [-1], [[(5, 1)]])
    rest = [_run(layer, storage, x[t : t + 1], [1], [1], [[(1, 1)]]) for t in range(5, 9)]
    assert storage.ssm(3).dtype == storage.conv(3).dtype == torch.bfloat16
    torch.testing.assert_close(first, want[:5], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(rest), want[5:], atol=0.1, rtol=0.05)
