"""GGUF blocks run as stored (cpu_ops.gguf_linear / gguf_rows, GGUFWeight): every block type
against gguf's own dequantizer on random blocks (scales from fp16 subnormals to 65504, zero,
negative; every 6-bit scale packing of the K-quants), every row count's path (registers up to 8
rows, a scratch row above; tails of 1-3), mixed-type segments, 1 and 2 threads, the plain-C and
vector builds, and refusals of what does not fit."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine.layers.gguf_linear import BLOCK_TYPES, KERNEL_ROWS, GGUFWeight, block_type

gguf_quants = pytest.importorskip("gguf.quants")
pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason=f"cpu kernels unavailable: {cpu_ops.unavailable()}")

#: byte offsets of each type's fp16 fields (d, and m / dmin where there is one)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(rng: np.random.Generator, name: str, n: int, k: int, extreme: bool = True) -> np.ndarray:
    """uint8 [n, row bytes]: random code bytes, finite fp16 scales of every magnitude."""
    _, qk, nbytes = BLOCK_TYPES[name]
    raw = rng.integers(0, 256, size=(n, k // qk, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        mag = 10.0 ** rng.integers(-7, 3, (n, k // qk)) if extreme else np.full((n, k // qk), 0.01)
        v = (rng.standard_normal((n, k // qk)) * mag).astype(np.float16)
        if extreme:
            v.flat[:: 7] = 0.0
            v.flat[3:: 11] = np.float16(65504.0) * np.sign(rng.standard_normal(v.flat[3:: 11].shape)).astype(np.float16)
            v.flat[5:: 13] = np.float16(6e-8)  # the smallest subnormal
        raw[:, :, off: off + 2] = v.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def weight_of(parts: list[tuple[str, np.ndarray]], k: int) -> tuple[GGUFWeight, np.ndarray]:
    """The GGUFWeight of ``parts`` and gguf's dequantization of it (fp32 [N, K])."""
    w = GGUFWeight([(BLOCK_TYPES[name][0], torch.from_numpy(raw.copy())) for name, raw in parts], k)
    ref = np.concatenate([gguf_quants.dequantize(raw, BLOCK_TYPES[name][0]).reshape(-1, k) for name, raw in parts])
    return w, ref


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_rows_equal_ggufs_dequantization_bit_for_bit(name, threads):
    rng = np.random.default_rng(sorted(BLOCK_TYPES).index(name))
    qk = BLOCK_TYPES[name][1]
    k = qk * 3 if qk == 256 else 32 * 7
    w, ref = weight_of([(name, random_blocks(rng, name, 45, k))], k)
    assert np.array_equal(w.dequantize().numpy().view(np.uint32), ref.view(np.uint32))
    ids = torch.tensor([44, 0, 7, 7, 30])
    assert np.array_equal(w.rows(ids).numpy().view(np.uint32), ref[ids.numpy()].view(np.uint32))
    assert np.array_equal(w._python_rows(ids).numpy().view(np.uint32), ref[ids.numpy()].view(np.uint32))


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error relative to the largest |want| of its row (rows of mixed magnitudes)."""
    scale = want.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    return float(((got.double() - want) / scale).abs().max())


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 13, KERNEL_ROWS])
def test_linear_is_the_dequantized_product(name, m, threads):
    rng = np.random.default_rng(100 + m)
    qk = BLOCK_TYPES[name][1]
    k = qk * 2 if qk == 256 else 32 * 5
    w, ref = weight_of([(name, random_blocks(rng, name, 37, k, extreme=False))], k)
    wide = torch.from_numpy(rng.standard_normal((m, k + 3)).astype(np.float32))
    x = wide[:, 1 : k + 1]  # rows at a stride
    want = x.double() @ torch.from_numpy(ref).double().t()
    assert _err(cpu_ops.gguf_linear(x, w.segments, *w.shape), want) < 1e-5


def test_mixed_segments_and_row_splits(threads):
    """A fused matrix of three types (Gemma 3's q, k in Q5_0, v in Q8_0) and of K-quants, row
    counts that split unevenly over the threads."""
    rng = np.random.default_rng(7)
    for parts, k in (((("Q5_0", 13), ("Q5_0", 5), ("Q8_0", 9)), 640), ((("Q4_K", 3), ("Q6_K", 17), ("Q5_K", 1)), 512),
                     ((("Q4_1", 1), ("Q4_0", 2), ("Q5_1", 30)), 96)):
        w, ref = weight_of([(name, random_blocks(rng, name, n, k, extreme=False)) for name, n in parts], k)
        assert w.type_names == tuple(name for name, _ in parts)
        for m in (1, 4, 6, 20):
            x = torch.randn(m, k)
            want = x.double() @ torch.from_numpy(ref).double().t()
            assert _err(w.linear(x, None), want) < 1e-5
        assert np.array_equal(w.dequantize().numpy(), ref)
        cat = GGUFWeight.cat([GGUFWeight([p], k) for p in w.parts])
        assert torch.equal(cat.segments, w.segments)


def test_more_rows_than_the_kernels_take_run_on_slices(monkeypatch):
    """Above KERNEL_ROWS rows (prefill) slices of the weight are dequantized one at a time."""
    import hybridkv.engine.layers.gguf_linear as gl

    rng = np.random.default_rng(3)
    w, ref = weight_of([("Q8_0", random_blocks(rng, "Q8_0", 50, 64, extreme=False))], 64)
    monkeypatch.setattr(gl, "DENSE_SLICE", 64 * 7)  # 7 rows a slice: 8 slices, the last short
    x = torch.randn(KERNEL_ROWS + 5, 64)
    want = x.double() @ torch.from_numpy(ref).double().t()
    bias = torch.randn(50)
    assert _err(w.linear(x, bias) - bias, want) < 1e-5
    x3 = x.view(1, KERNEL_ROWS + 5, 64)
    assert w.linear(x3, None).shape == (1, KERNEL_ROWS + 5, 50)
    assert w.linear(x.bfloat16()[:3], None).dtype == torch.bfloat16


def test_prefill_slices_in_two_threads_at_once(monkeypatch):
    """Engines stepping in two threads: each thread's slices decode into its own buffer."""
    import hybridkv.engine.layers.gguf_linear as gl
    from tests.support.threads import disagreeing_calls

    rng = np.random.default_rng(5)
    monkeypatch.setattr(gl, "DENSE_SLICE", 64 * 5)
    ws = [weight_of([(name, random_blocks(rng, name, 23, 64, extreme=False))], 64)[0] for name in ("Q8_0", "Q4_1")]
    xs = [torch.randn(KERNEL_ROWS + 3, 64) for _ in ws]
    want = [w.linear(x, None) for w, x in zip(ws, xs)]
    calls = [lambda w=w, x=x: w.linear(x, None) for w, x in zip(ws, xs)]
    assert disagreeing_calls(calls, want, rounds=40) == []


def test_what_does_not_fit_is_refused():
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(random_blocks(rng, "Q8_0", 4, 64))
    with pytest.raises(ValueError):
        GGUFWeight([(8, raw)], 96)  # row bytes of another K
    with pytest.raises(ValueError):
        GGUFWeight([(1, raw)], 64)  # F16: not a block type the kernels read
    with pytest.raises(ValueError):
        GGUFWeight([], 64)
    w = GGUFWeight([(8, raw)], 64)
    bad = w.segments.clone()
    bad[0, 1] = 5  # more rows than the weight says
    with pytest.raises(ValueError):
        cpu_ops.gguf_linear(torch.randn(2, 64), bad, 4, 64)
    bad = w.segments.clone()
    bad[0, 0] = 12  # Q4_K: 64 is not a whole number of its blocks
    with pytest.raises(ValueError):
        cpu_ops.gguf_rows(bad, 4, 64)
    with pytest.raises(IndexError):
        w.rows(torch.tensor([4]))
    with pytest.raises(IndexError):
        w._python_rows(torch.tensor([-1]))
    with pytest.raises(ValueError):
        cpu_ops.gguf_linear(torch.randn(2, 63), w.segments, 4, 64)
    assert block_type("Q6_K", 640) is None and block_type("Q6_K", 512) == (14, 256, 210)


_BUILD_CHECK = """
import numpy as np, torch, sys
sys.path.insert(0, {tests!r})
from hybridkv.engine import cpu_ops
from hybridkv.engine.cpu_ops.isa import cpu_isa
assert cpu_ops.load() is not None, cpu_ops.unavailable()
from engine.test_gguf_blocks import random_blocks, weight_of, BLOCK_TYPES, _err
rng = np.random.default_rng(0); worst = 0.0; exact = True
for name, (tid, qk, nb) in sorted(BLOCK_TYPES.items()):
    k = 2 * qk if qk == 256 else 96
    w, ref = weight_of([(name, random_blocks(rng, name, 21, k))], k)
    exact &= np.array_equal(w.dequantize().numpy().view(np.uint32), ref.view(np.uint32))
    w, ref = weight_of([(name, random_blocks(rng, name, 21, k, extreme=False))], k)
    for m in (1, 3, 8, 11):
        x = torch.randn(m, k)
        worst = max(worst, _err(w.linear(x, None), x.double() @ torch.from_numpy(ref).double().t()))
print(cpu_isa().level, exact, worst < 1e-5, worst)
"""


@pytest.mark.parametrize("env", [{"HYBRIDKV_CPU_OPS": "generic"}, {}], ids=["plain-C", "this-cpu"])
def test_each_build_decodes_every_type(tmp_path, env):
    """The plain-C build (no intrinsics) and the one for this CPU (AVX2 / AVX-512 vector code)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _BUILD_CHECK.format(tests=tests)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HYBRIDKV_CACHE_DIR": str(tmp_path / "cache"), **env})
    assert done.returncode == 0, done.stderr
    level, exact, close, _ = done.stdout.split()
    assert exact == "True" and close == "True", done.stdout
