"""The quantized matmul kernels (cpu_ops.q8_linear / q4_linear) and their thread pool, against
fp64 references on random shapes: every tail (K not a multiple of 16 or 32, N not of 4, M not
of 4), both input precisions (fp32; bf16 from 8 rows on), 1 and 2 threads, the plain-C build,
concurrent callers and a forked child."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.threads import disagreeing_calls

from hybridkv.engine import cpu_ops
from hybridkv.engine.layers.quantized_linear import KERNEL_ROWS, Int4Weight, Int8Weight

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason=f"cpu kernels unavailable: {cpu_ops.unavailable()}")

#: from this many rows on, bf16 compute rounds the inputs to bf16 (qmatmul.c BF16_ROWS)
BF16_ROWS = 8


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _rows(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    """[m, k] fp32 rows with a row stride (a slice of a wider tensor), of mixed magnitudes."""
    wide = torch.randn(m, k + 5, generator=g) * (10.0 ** torch.randint(-2, 3, (m, 1), generator=g).float())
    return wide[:, 2 : k + 2]


def _check(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = want.abs().max().clamp(min=1e-30)
    err = ((got.double() - want).abs().max() / scale).item()
    assert err < tol, err


@pytest.mark.parametrize("seed", range(14))
def test_int8_matches_fp64_on_random_shapes(seed, threads):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 70, (1,), generator=g))
    k = [1, 5, 16, 17, 33, 64, 100, 576][seed % 8]
    m = [1, 2, 3, 4, 5, 8, 13, 32][(seed // 2) % 8]
    w = Int8Weight(torch.randn(n, k, generator=g), torch.float32)
    x = _rows(g, m, k)
    want = cpu_ops.rounded_rows(x) @ (w.q.double() * w.scales32.double().unsqueeze(1)).t()
    _check(cpu_ops.q8_linear(x, w.q, w.scales32), want, 1e-5)
    bf16 = cpu_ops.q8_linear(x, w.q, w.scales32, bf16=True)
    if m >= BF16_ROWS:  # the inputs rounded to bf16; the codes are exact in it
        _check(bf16, _bf16(x) @ (w.q.double() * w.scales32.double().unsqueeze(1)).t(), 1e-5)
    else:
        _check(bf16, want, 1e-5)


@pytest.mark.parametrize("seed", range(14))
def test_int4_matches_fp64_on_random_shapes(seed, threads):
    g = torch.Generator().manual_seed(seed)
    group = [32, 64, 128][seed % 3]
    n = int(torch.randint(1, 70, (1,), generator=g))
    k = group * int(torch.randint(1, 5, (1,), generator=g))
    m = [1, 2, 3, 4, 5, 8, 13, 32][(seed // 2) % 8]
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    w = Int4Weight(torch.randn(n, k, generator=g) * 3 + 1, group, dtype)
    assert set(torch.stack([w.nibbles & 15, w.nibbles >> 4]).unique().tolist()) <= set(range(16))
    x = _rows(g, m, k)
    deq = w.dequantize().double()  # [N, K]: (code - 8) * scale + zero
    got = cpu_ops.q4_linear(x, w.nibbles, w.scales_zeros, group)
    if dtype == torch.bfloat16 and m >= BF16_ROWS:  # inputs and weights rounded to bf16
        _check(got, _bf16(x) @ _bf16(deq).t(), 1e-5)
    else:
        _check(got, cpu_ops.rounded_rows(x, group) @ deq.t(), 1e-5)


def test_zero_rows_and_every_code():
    codes = torch.arange(16).repeat(2, 4).float()  # [2, 64]: every code, both nibbles
    w = Int4Weight(codes, 32, torch.float32)
    assert torch.equal(w.dequantize(), codes)
    eye = torch.eye(64)
    assert torch.equal(cpu_ops.q4_linear(eye, w.nibbles, w.scales_zeros, 32), codes.t())
    assert cpu_ops.q4_linear(torch.zeros(0, 64), w.nibbles, w.scales_zeros, 32).shape == (0, 2)
    q = Int8Weight(codes - 8, torch.float32)
    assert cpu_ops.q8_linear(torch.zeros(0, 64), q.q, q.scales32).shape == (0, 2)


def test_the_wrappers_refuse_what_the_kernels_cannot_read():
    w8 = Int8Weight(torch.randn(8, 32), torch.float32)
    w4 = Int4Weight(torch.randn(8, 64), 32, torch.bfloat16)
    x = torch.randn(2, 32)
    bad = [
        lambda: cpu_ops.q8_linear(x.double(), w8.q, w8.scales32),
        lambda: cpu_ops.q8_linear(x.t().contiguous().t(), w8.q, w8.scales32),  # no unit stride in K
        lambda: cpu_ops.q8_linear(torch.randn(2, 31), w8.q, w8.scales32),
        lambda: cpu_ops.q8_linear(x, w8.q.t(), w8.scales32),
        lambda: cpu_ops.q8_linear(x, w8.q, w8.scales32[:4]),
        lambda: cpu_ops.q8_linear(x, w8.q, w8.scales32.half()),
        lambda: cpu_ops.q8_linear(x[0], w8.q, w8.scales32),
        lambda: cpu_ops.q4_linear(torch.randn(2, 64), w4.nibbles, w4.scales_zeros, 16),
        lambda: cpu_ops.q4_linear(torch.randn(2, 64), w4.nibbles, w4.scales_zeros, 64),  # shapes disagree
        lambda: cpu_ops.q4_linear(torch.randn(2, 64), w4.nibbles.int(), w4.scales_zeros, 32),
        lambda: cpu_ops.q4_linear(torch.randn(2, 64), w4.nibbles, w4.scales_zeros.half(), 32),
        lambda: cpu_ops.q4_linear(torch.randn(2, 64), w4.nibbles[:, :16], w4.scales_zeros, 32),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_weight_classes_agree_with_torchs_kernels(mode):
    """Int8Weight / Int4Weight.linear on the C kernels vs torch's own quantized kernels (bf16
    inputs) on the same codes: equal to bf16 rounding, at decode sizes and beyond KERNEL_ROWS."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 128, generator=g)
    q = Int8Weight(w, torch.bfloat16) if mode == "int8" else Int4Weight(w, 32, torch.bfloat16)
    for m in (1, 3, 9, KERNEL_ROWS, KERNEL_ROWS + 5):
        x = torch.randn(m, 128, generator=g)
        got = q.linear(x, None)
        if mode == "int8":
            want = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q.q, q.scales).float()
        else:
            packed, sz = q.torch_layout()
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz)[:, :96].float()
        assert got.dtype == torch.float32 and got.shape == (m, 96)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_concurrent_callers_get_their_own_results():
    """Python threads calling at once (the GIL released in the kernels): one job at a time in the
    pool, each caller's output its own."""
    ops = cpu_ops.load()
    before = ops.get_threads()
    ops.set_threads(2)
    try:
        g = torch.Generator().manual_seed(3)
        weights = [Int8Weight(torch.randn(300, 96, generator=g), torch.float32) for _ in range(3)]
        inputs = [torch.randn(5, 96, generator=g) for _ in range(3)]
        want = [cpu_ops.q8_linear(x, w.q, w.scales32) for x, w in zip(inputs, weights)]
        calls = [lambda x=x, w=w: cpu_ops.q8_linear(x, w.q, w.scales32) for x, w in zip(inputs, weights)]
        assert disagreeing_calls(calls, want, rounds=60, timeout=60) == []
    finally:
        ops.set_threads(before)


def _run(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_forked_child_starts_its_own_workers():
    code = (
        "import os, torch\n"
        "from hybridkv.engine import cpu_ops\n"
        "ops = cpu_ops.load(); ops.set_threads(2)\n"
        "q = torch.randint(-127, 128, (512, 64), dtype=torch.int8); s = torch.rand(512); x = torch.randn(3, 64)\n"
        "want = cpu_ops.q8_linear(x, q, s)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = all(torch.equal(cpu_ops.q8_linear(x, q, s), want) for _ in range(20))\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status), torch.equal(cpu_ops.q8_linear(x, q, s), want))\n"
    )
    assert _run(code) == "child 0 True"


def _builds():
    """(environment, the ISA level it must give) for every build this CPU runs: the plain-C one
    (HYBRIDKV_CPU_OPS=generic), and each intrinsics level up to the CPU's own."""
    from hybridkv.engine.cpu_ops.isa import LEVELS, cpu_isa

    here = LEVELS.index(cpu_isa().level)
    out = [pytest.param({"HYBRIDKV_CPU_OPS": "generic"}, None, id="generic")]
    for level in ("avx512", "avx2"):
        marks = [] if LEVELS.index(level) >= here else [pytest.mark.skip(reason=f"this CPU has no {level}")]
        out.append(pytest.param({"HYBRIDKV_CPU_ISA": level}, level, id=level, marks=marks))
    return out


@pytest.mark.parametrize(("env", "level"), _builds())
def test_each_build_this_cpu_runs_computes_the_same(tmp_path, env, level):
    """The plain-C build (no intrinsics), the AVX2 + FMA build (-march=x86-64-v3, on any x86 CPU
    with AVX2, AVX-512 ones included) and the AVX-512 one: the same fp64 reference on random
    shapes, of the rows as each build multiplies them (the AVX2 one rounds them to int16 in
    blocks of 256 columns, the others keep fp32)."""
    code = (
        "import torch\n"
        "from hybridkv.engine import cpu_ops\n"
        "from hybridkv.engine.cpu_ops.isa import cpu_isa\n"
        "print(cpu_isa().level, cpu_ops.rounding_block())\n"
        "from hybridkv.engine.layers.quantized_linear import Int8Weight, Int4Weight\n"
        "assert cpu_ops.load() is not None, cpu_ops.unavailable()\n"
        "g = torch.Generator().manual_seed(0); worst = 0.0\n"
        "for n, k, m in ((7, 45, 3), (33, 64, 9), (5, 128, 1), (70, 100, 2), (4, 8, 5), (9, 17, 4), (12, 256, 33), (6, 7, 1)):\n"
        "    x = torch.randn(m, k, generator=g); w = torch.randn(n, k, generator=g)\n"
        "    q = Int8Weight(w, torch.float32)\n"
        "    ref = cpu_ops.rounded_rows(x) @ (q.q.double() * q.scales32.double()[:, None]).t()\n"
        "    worst = max(worst, ((cpu_ops.q8_linear(x, q.q, q.scales32).double() - ref).abs().max() / ref.abs().max()).item())\n"
        "    if k % 32 == 0:\n"
        "        for dt in (torch.float32, torch.bfloat16):\n"
        "            q4 = Int4Weight(w, 32, dt); d = q4.dequantize().double()\n"
        "            xr, dr = (x.bfloat16().double(), d.bfloat16().double()) if dt == torch.bfloat16 and m >= 8 else (cpu_ops.rounded_rows(x, 32), d)\n"
        "            ref = xr @ dr.t()\n"
        "            got = cpu_ops.q4_linear(x, q4.nibbles, q4.scales_zeros, 32).double()\n"
        "            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())\n"
        "print('worst', worst < 1e-5, worst)\n"
    )
    out = _run(code, HYBRIDKV_CACHE_DIR=str(tmp_path / "cache"), **env).splitlines()
    assert level is None or out[0].split()[0] == level, out
    assert out[0].split()[1] == ("256" if level == "avx2" else "0"), out
    assert out[-1].startswith("worst True"), out


def test_hold_cores_hands_the_threads_over_and_back():
    ops = cpu_ops.load()
    torch_threads, kernel_threads = torch.get_num_threads(), ops.get_threads()
    was = cpu_ops._state.get("kernels", False)
    try:
        cpu_ops.hold_cores(False)
        torch.set_num_threads(2)
        cpu_ops.hold_cores(True)
        assert (torch.get_num_threads(), ops.get_threads()) == (1, 2)
        cpu_ops.hold_cores(True)  # sticky: nothing changes
        assert (torch.get_num_threads(), ops.get_threads()) == (1, 2)
        cpu_ops.hold_cores(False)
        assert (torch.get_num_threads(), ops.get_threads()) == (2, 1)
    finally:
        cpu_ops.hold_cores(was)
        torch.set_num_threads(torch_threads)
        ops.set_threads(kernel_threads)


def _as_avx2_rounds(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """The AVX2 rounding's contract restated on its own (per block of 256 columns, or the
    multiple of the int4 group from 256 up: ``round(x * (32767 / amax)) * (amax / 32767)``)."""
    block = 256 if group <= 0 else (group if group >= 256 else -(-256 // group) * group)
    out = torch.empty(x.shape, dtype=torch.float64)
    for k0 in range(0, x.shape[1], block):
        for r in range(x.shape[0]):
            part = x[r, k0 : k0 + block]
            amax = part.abs().max()
            if not torch.isfinite(amax) or part.isnan().any():
                out[r, k0 : k0 + block] = float("nan")
            elif amax == 0:
                out[r, k0 : k0 + block] = 0.0
            else:
                inv, step = torch.tensor(32767.0) / amax, amax / torch.tensor(32767.0)
                out[r, k0 : k0 + block] = torch.round(part * inv).double() * step.double()
    return out


def test_the_rounding_of_the_rows_is_what_its_docstring_says():
    """rounded_rows (the tests' reference of the AVX2 kernels) against the contract written out
    element by element, on mixed magnitudes, zeros, nan and inf, every group size; its worked
    example; and no rounding at all where the build keeps fp32 rows."""
    g = torch.Generator().manual_seed(11)
    block = cpu_ops.rounding_block()
    if not block:
        x = torch.randn(3, 300, generator=g)
        assert torch.equal(cpu_ops.rounded_rows(x), x.double())
        pytest.skip("this build keeps fp32 rows (no AVX2-only kernels)")
    assert block == 256 and cpu_ops.rounding_block(32) == 256 and cpu_ops.rounding_block(96) == 288
    assert cpu_ops.rounding_block(512) == 512
    ex = cpu_ops.rounded_rows(torch.tensor([[0.5, -1.0, 0.25]]))
    assert torch.equal(ex, torch.tensor([[16384.0, -32767.0, 8192.0]], dtype=torch.float64)
                       * (torch.tensor(1.0) / torch.tensor(32767.0)).double())
    for group in (0, 32, 64, 96, 128, 512):
        x = torch.randn(5, 1024 + 64, generator=g) * 10.0 ** torch.randint(-3, 4, (5, 1), generator=g).float()
        x[1, :300] = 0.0
        x[2, 7] = float("nan")
        x[3, 900] = float("inf")
        got, want = cpu_ops.rounded_rows(x, group), _as_avx2_rounds(x, group)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        width = cpu_ops.rounding_block(group)
        for k0 in range(0, x.shape[1], width):  # within half a step (plus the fp32 product's rounding)
            part = x[[0, 1, 4], k0 : k0 + width].double()
            step = part.abs().amax(dim=1, keepdim=True) / 32767
            assert ((got[[0, 1, 4], k0 : k0 + width] - part).abs() <= 0.502 * step).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_non_finite_rows_give_nan_and_zero_rows_zero(kind):
    """A row with a nan or an inf gives nan in every output (no finite garbage), whatever the
    build; a zero row gives zeros; the other rows are untouched by their neighbours."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(12, 320, generator=g)
    x = torch.randn(4, 320, generator=g)
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    x[2] = 0.0
    if kind == "int8":
        q = Int8Weight(w, torch.float32)
        got = cpu_ops.q8_linear(x, q.q, q.scales32)
        alone = cpu_ops.q8_linear(x[3:], q.q, q.scales32)
    else:
        q = Int4Weight(w, 32, torch.float32)
        got = cpu_ops.q4_linear(x, q.nibbles, q.scales_zeros, 32)
        alone = cpu_ops.q4_linear(x[3:], q.nibbles, q.scales_zeros, 32)
    assert got[0].isnan().all() and (got[1].isnan() | got[1].isinf()).all()
    assert torch.equal(got[2], torch.zeros(12)) and torch.equal(got[3:], alone)


def test_the_worked_example_of_the_rounding():
    """qmatmul_avx2.c's example, on every build: x [0.5, -1, 0.25] times q [2, 1, -4] at scale
    0.5 is -0.5 (rounded rows 16384, -32767, 8192 steps of 1/32767, the biases cancelling)."""
    x = torch.tensor([[0.5, -1.0, 0.25]])
    got = cpu_ops.q8_linear(x, torch.tensor([[2, 1, -4]], dtype=torch.int8), torch.tensor([0.5]))
    assert got.shape == (1, 1) and abs(got.item() + 0.5) < 1e-6, got
