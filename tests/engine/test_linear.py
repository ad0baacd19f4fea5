"""Fused projections and prepacked linears (transposed / oneDNN copies): same parameters, same results as F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.host_tensors import long_tensor
from hybridkv.engine.models import load_model
from hybridkv.engine.layers.linear import SMALL_ROWS, Linear, PackedWeight, fuse_linears, linear, prepack_available

needs_onednn = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN prepacking")


def test_fused_linears_are_views_with_the_same_values():
    torch.manual_seed(0)
    parts = [Linear(16, n, bias=b) for n, b in ((8, True), (4, False), (4, True))]
    before = [(p.weight.clone(), None if p.bias is None else p.bias.clone()) for p in parts]
    x = torch.randn(5, 16)
    want = torch.cat([p(x) for p in parts], dim=-1)
    weight, bias = fuse_linears(parts)
    assert weight.shape == (16, 16) and bias.shape == (16,)
    assert torch.equal(bias[8:12], torch.zeros(4))  # the bias-less part adds zeros
    for p, (w, b) in zip(parts, before):
        assert torch.equal(p.weight, w) and (b is None or torch.equal(p.bias, b))
        assert p.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()  # no copy kept
    torch.testing.assert_close(F.linear(x, weight, bias), want)


@pytest.mark.parametrize("rows", [1, 33, SMALL_ROWS, SMALL_ROWS + 1, 300], ids=lambda r: f"{r}-rows")
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "transposed-only"])
def test_packed_kernels_match_f_linear(rows, onednn):
    if onednn and not prepack_available():
        pytest.skip("this torch build has no oneDNN prepacking")
    torch.manual_seed(2)
    lin = Linear(256, 96)
    packed = PackedWeight(lin.weight, onednn=onednn)
    assert packed.transposed.shape == (256, 96) and packed.transposed.is_contiguous()
    x = torch.randn(rows, 256)
    want = F.linear(x, lin.weight, lin.bias)
    for bias in (lin.bias, None):
        got = linear(x, lin.weight, bias, packed)
        torch.testing.assert_close(got, want if bias is not None else want - lin.bias, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_prepacked_linear_matches_and_notices_changed_weights():
    torch.manual_seed(1)
    lin = Linear(256, 96)
    lin.prepack()
    assert lin.packed is not None and lin.packed.packed is not None
    x = torch.randn(33, 256)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the packed copy is stale and must not be used
    assert not lin.packed.valid_for(lin.weight)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.prepack(False)
    assert lin.packed is None
    assert PackedWeight.make(lin.weight.to(torch.float64)) is None  # fp32 only
    assert linear(x, lin.weight, None, None).shape == (33, 96)


def test_prepacked_model_matches_plain_model(tiny_models):
    path, _ = tiny_models("llama4_dense")
    packed, plain = load_model(path), load_model(path, prepack=False)
    assert list(packed.state_dict()) == list(plain.state_dict())  # names unchanged by fusing / packing
    for (name, a), (_, b) in zip(packed.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name
    attn = packed.model.layers[0].self_attn
    assert attn.qkv_weight is not None and attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    if prepack_available():
        assert attn.qkv_packed is not None and packed.lm_head.packed is not None
    assert plain.lm_head.packed is None and plain.model.layers[0].feed_forward.gate_up_packed is None


def test_long_tensor():
    assert long_tensor([3, -1, 7]).tolist() == [3, -1, 7]
    assert long_tensor([]).shape == (0,) and long_tensor([]).dtype == torch.long
    assert long_tensor(range(4)).dtype == torch.long
    with pytest.raises(OverflowError):
        long_tensor([1 << 70])


@pytest.mark.parametrize("forced", ["transposed", "onednn"])
def test_decode_kernel_is_forced_by_the_environment_and_both_match_f_linear(forced, monkeypatch):
    from hybridkv.engine.layers import linear as linear_module

    monkeypatch.setenv("HYBRIDKV_DECODE_GEMM", forced)
    linear_module.decode_kernel.cache_clear()
    try:
        want = forced if forced == "transposed" or prepack_available() else "transposed"
        assert linear_module.decode_kernel() == want
        torch.manual_seed(3)
        lin = Linear(64, 48)
        lin.prepack()
        for rows in (1, 7, SMALL_ROWS, SMALL_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
        x3 = torch.randn(2, 3, 64)  # not 2-D: never the transposed copy's torch.mm
        torch.testing.assert_close(lin(x3), F.linear(x3, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    finally:
        monkeypatch.delenv("HYBRIDKV_DECODE_GEMM")
        linear_module.decode_kernel.cache_clear()


def test_decode_kernel_probe_picks_a_known_kernel(monkeypatch):
    from hybridkv.engine.layers import linear as linear_module

    monkeypatch.setenv("HYBRIDKV_DECODE_GEMM", "no-such-kernel")  # ignored: the probe decides
    linear_module.decode_kernel.cache_clear()
    try:
        assert linear_module.decode_kernel() in linear_module.DECODE_KERNELS
    finally:
        linear_module.decode_kernel.cache_clear()
