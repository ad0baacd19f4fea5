"""RMSNorm's one-op forms, the stacked per-head norms and the four-op rotate-half RoPE,
each against HF's formula bit for bit, on random shapes, scales and dtypes."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.layers.norms import RMSNorm, rms_norm_heads
from hybridkv.engine.layers.rope import RotaryEmbedding, apply_rotate_half

DTYPES = (torch.float32, torch.bfloat16)


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """HF's Llama / Gemma RMSNorm, op for op."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + w.float())).to(x.dtype)
    return w * normed.to(x.dtype)


def random_case(gen: torch.Generator, dtype: torch.dtype):
    dim = [8, 64, 256, 576, 640][int(torch.randint(0, 5, (1,), generator=gen))]
    shape = [int(torch.randint(1, 9, (1,), generator=gen)) for _ in range(int(torch.randint(1, 3, (1,), generator=gen)))]
    scale = 10.0 ** float(torch.empty(1).uniform_(-3, 3, generator=gen))
    x = (torch.randn(*shape, dim, generator=gen) * scale).to(dtype)
    w = (torch.randn(dim, generator=gen) * 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_equals_hf_bit_for_bit(dtype, unit_offset):
    gen = torch.Generator().manual_seed(7 + unit_offset)
    for _ in range(60):
        x, w = random_case(gen, dtype)
        norm = RMSNorm(x.shape[-1], 1e-6, unit_offset=unit_offset).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
        got = norm(x)
        assert got.dtype == x.dtype
        assert torch.equal(got, hf_rms_norm(x, norm.weight, 1e-6, unit_offset))


def test_rms_norm_multiplier_follows_weight_changes():
    norm = RMSNorm(16, 1e-6, unit_offset=True)
    x = torch.randn(3, 16)
    first = norm(x)
    with torch.no_grad():
        norm.weight.mul_(3.0)  # in place: a new version
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6, True))
    assert not torch.equal(norm(x), first)
    norm.weight = torch.nn.Parameter(torch.randn(16))  # replaced
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6, True))
    norm.to(torch.bfloat16)  # cast
    xb = x.to(torch.bfloat16)
    assert torch.equal(norm(xb), hf_rms_norm(xb, norm.weight, 1e-6, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_heads_equals_one_norm_per_part(dtype, unit_offset):
    gen = torch.Generator().manual_seed(11 + unit_offset)
    for _ in range(30):
        dim = [16, 64, 256][int(torch.randint(0, 3, (1,), generator=gen))]
        counts = [int(torch.randint(1, 6, (1,), generator=gen)) for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))]
        t = int(torch.randint(1, 7, (1,), generator=gen))
        norms = []
        for c in counts:
            n = RMSNorm(dim, 1e-6, unit_offset=unit_offset).to(dtype)
            with torch.no_grad():
                n.weight.copy_(torch.randn(dim, generator=gen) * 0.5)
            norms.append((n, c))
        wide = torch.randn(t, sum(counts) + 2, dim, generator=gen).to(dtype)
        x = wide[:, : sum(counts)]  # a strided view, as the fused q/k/v projection gives
        cache: dict = {}
        for _ in range(2):  # the second call reads the cache
            got = rms_norm_heads(x, norms, cache)
            want, start = [], 0
            for n, c in norms:
                want.append(n(x[:, start : start + c]))
                start += c
            assert torch.equal(got, torch.cat(want, dim=1))
        with torch.no_grad():
            norms[-1][0].weight.add_(1.0)
        want_last = norms[-1][0](x[:, sum(counts) - counts[-1]:])
        assert torch.equal(rms_norm_heads(x, norms, cache)[:, sum(counts) - counts[-1]:], want_last)


def test_rms_norm_heads_refuses_mixed_norms():
    with pytest.raises(ValueError):
        rms_norm_heads(torch.randn(1, 2, 8), [(RMSNorm(8, 1e-6), 1), (RMSNorm(8, 1e-5), 1)], {})


def hf_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb: cos / sin [T, D] (the half tables repeated), x [T, H, D]."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float16,))
def test_rotate_half_equals_hf_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        dim = [8, 64, 128, 256][int(torch.randint(0, 4, (1,), generator=gen))]
        t, h = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10_000.0}, dim, 4096)
        positions = torch.randint(0, 4096, (t,), generator=gen)
        cos, sin = rotary.cos_sin(positions, dtype)  # [T, 1, D] each
        angles = rotary.freqs(positions)
        hf_cos = torch.cat((angles, angles), dim=-1).cos().to(dtype)
        hf_sin = torch.cat((angles, angles), dim=-1).sin().to(dtype)
        x = (torch.randn(t, h + 1, dim, generator=gen) * 4).to(dtype)[:, :h]  # strided, as q/k views are
        assert torch.equal(apply_rotate_half(x, cos, sin), hf_rotate_half(x, hf_cos, hf_sin))
