"""The fused CPU kernels (hybridkv.engine.cpu_ops) against torch, the "cpu" attention backend's
choice, and what happens where the kernels cannot be built. The attention kernel is also run
against the dense reference in tests/engine/test_attention.py (backend "cpu")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tests.support.tiers import fast_tier, slow_except

from hybridkv.engine import cpu_ops
from hybridkv.engine.attention.registry import resolve_backend
from hybridkv.errors import InvalidConfigError

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason=f"cpu kernels unavailable: {cpu_ops.unavailable()}")


def _torch_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * scale


@pytest.mark.parametrize("seed", range(12))
def test_rms_norm_matches_torch_on_random_shapes_and_strides(seed):
    g = torch.Generator().manual_seed(seed)
    t, h = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    d = [1, 7, 64, 100, 256][seed % 5]
    big = torch.randn(t, h + 2, d + 3, generator=g) * (10.0 ** float(torch.randint(-3, 4, (1,), generator=g)))
    x = big[:, 1 : h + 1, 2 : d + 2]  # [T, H, D] strided rows, unit stride in D
    per_head = torch.rand(h, d, generator=g) + 0.5
    eps = [1e-6, 1e-5, 0.1][seed % 3]
    torch.testing.assert_close(cpu_ops.rms_norm(x, per_head, eps), _torch_norm(x, per_head, eps), rtol=1e-5, atol=1e-6)
    flat = big[:, 0, :d]  # [T, D] with a row stride
    one = torch.rand(d, generator=g)
    torch.testing.assert_close(cpu_ops.rms_norm(flat, one, eps), _torch_norm(flat, one, eps), rtol=1e-5, atol=1e-6)


def test_rms_norm_of_zeros_is_zero():
    out = cpu_ops.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)
    assert torch.equal(out, torch.zeros(2, 8))


@pytest.mark.parametrize("seed", range(8))
def test_rope_is_the_torch_ops_bit_for_bit(seed):
    from hybridkv.engine.layers.rope import RotaryEmbedding, apply_rotate_half

    g = torch.Generator().manual_seed(seed)
    t, h = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    d = [2, 8, 64, 128][seed % 4]
    rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, d, 4096)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (t,), generator=g), torch.float32)  # [T, 1, D]
    qkv = torch.randn(t, h + 3, d, generator=g) * 50
    x = qkv[:, : h + 1]  # the q and k heads of a fused projection: strided rows
    want = apply_rotate_half(x, cos, sin)
    assert torch.equal(cpu_ops.rope_rotate_half(x, cos, sin), want)
    assert torch.equal(apply_rotate_half(x, cos, sin, fused=True), want)
    assert torch.equal(apply_rotate_half(x.double(), cos.double(), sin.double(), fused=True),
                       apply_rotate_half(x.double(), cos.double(), sin.double()))  # not fp32: torch's ops


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("seed", range(6))
def test_gated_activation_matches_torch(act, seed):
    g = torch.Generator().manual_seed(seed)
    t, i = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
    big = torch.randn(t, 2 * i + 5, generator=g) * [0.01, 1.0, 30.0][seed % 3]
    big[0, :3] = torch.tensor([-200.0, 0.0, 200.0])[: min(3, i)] if i >= 3 else big[0, :3]
    gate_up = big[:, : 2 * i]  # a row stride past 2I
    f = torch.nn.functional.silu if act == "silu" else (lambda z: torch.nn.functional.gelu(z, approximate="tanh"))
    want = (f(gate_up[:, :i].double()) * gate_up[:, i:].double()).float()  # fp64: torch's fp32 gelu cancels at x << 0
    torch.testing.assert_close(cpu_ops.gated_act(gate_up, act), want, rtol=2e-6, atol=1e-6)


def _dense(q, k, v, scale):
    """q [Hq, D], k / v [n, Hkv, D] -> [Hq, D]."""
    rep = q.shape[0] // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, n, D]
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q.double(), kk.double()) * scale, -1)
    return torch.einsum("hn,hnd->hd", p, vv.double()).float()


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def kernel_threads(request):
    """The kernels' threads (the decode attention splits its sequences over them)."""
    before = cpu_ops.load().get_threads()
    cpu_ops.load().set_threads(request.param)
    yield request.param
    cpu_ops.load().set_threads(before)


KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(10))
def test_decode_attention_writes_then_attends_through_random_tables(seed, kernel_threads, kv_dtype):
    """Every cache dtype: the new K/V stored as torch's ``.to(dtype)`` rounds it, the attention
    against a dense fp64 reference over the stored (widened) values."""
    g = torch.Generator().manual_seed(seed)
    hkv, rep = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    d, bs = [8, 16, 64, 80][seed % 4], [1, 3, 4, 16][seed % 4]
    s = int(torch.randint(1, 11, (1,), generator=g))
    width = 12
    num_blocks = s * width + 1
    kv = torch.randn(2 * hkv, num_blocks * bs, d, generator=g).to(kv_dtype)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: s * width] + 1).view(s, width)
    pos = torch.randint(0, width * bs, (s,), generator=g)
    first = (pos - torch.randint(0, width * bs, (s,), generator=g)).clamp(min=0)
    # extreme scores: the softmax's exp must hold up far from 0
    q = torch.randn(s, hkv * rep, d, generator=g) * (30.0 if seed % 3 == 0 else 1.0)
    k_new, v_new = torch.randn(s, hkv, d, generator=g), torch.randn(s, hkv, d, generator=g)
    want_kv = kv.clone()
    for i in range(s):
        p = int(pos[i])
        slot = int(tables[i, p // bs]) * bs + p % bs
        want_kv[:hkv, slot], want_kv[hkv:, slot] = k_new[i].to(kv_dtype), v_new[i].to(kv_dtype)
    out = cpu_ops.decode_attention(q, k_new, v_new, kv, tables, first, pos, bs, 0.37)
    assert torch.equal(kv, want_kv)
    for i in range(s):
        ps = torch.arange(int(first[i]), int(pos[i]) + 1)
        slots = tables[i, ps // bs] * bs + ps % bs
        k, v = kv[:hkv, slots].transpose(0, 1).float(), kv[hkv:, slots].transpose(0, 1).float()  # [n, Hkv, D]
        torch.testing.assert_close(out[i], _dense(q[i], k, v, 0.37), rtol=1e-4, atol=1e-5)
    again = cpu_ops.decode_attention(q, None, None, kv, tables, first, pos, bs, 0.37)  # nothing written
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("seed", slow_except(range(8), 3))
def test_decode_attention_over_long_ranges_is_the_same_on_any_thread_count(seed):
    """Key ranges of up to ~1,600 keys (the kernel cuts each (sequence, KV head)'s keys into
    units of 256 and combines their softmax pieces): one KV head and one sequence included (all
    its units spread over the threads), windows that start mid-block and mid-unit, every block
    size, each cache dtype in turn; against a dense fp64 reference, and bit for bit the same on
    1, 2 and 3 threads."""
    g = torch.Generator().manual_seed(100 + seed)
    kv_dtype = KV_DTYPES[seed % 3]
    hkv, rep = [1, 1, 2, 3][seed % 4], int(torch.randint(1, 5, (1,), generator=g))
    d, bs = [8, 64, 16, 80][seed % 4], [1, 16, 5, 32][seed % 4]
    s = 1 if seed % 2 == 0 else int(torch.randint(2, 6, (1,), generator=g))
    width = -(-1600 // bs)
    num_blocks = s * width + 1
    kv = torch.randn(2 * hkv, num_blocks * bs, d, generator=g).to(kv_dtype)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: s * width] + 1).view(s, width)
    pos = torch.randint(200, width * bs, (s,), generator=g)
    pos[0] = width * bs - 1
    first = (pos - torch.randint(0, width * bs, (s,), generator=g)).clamp(min=0)
    first[0] = [0, 257, 3, 511][seed % 4]
    q = torch.randn(s, hkv * rep, d, generator=g) * (20.0 if seed % 3 == 0 else 1.0)
    k_new, v_new = torch.randn(s, hkv, d, generator=g), torch.randn(s, hkv, d, generator=g)
    ops = cpu_ops.load()
    before = ops.get_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            ops.set_threads(threads)
            cache = kv.clone()
            outs.append(cpu_ops.decode_attention(q, k_new, v_new, cache, tables, first, pos, bs, 0.21))
    finally:
        ops.set_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for i in range(s):
        ps = torch.arange(int(first[i]), int(pos[i]) + 1)
        slots = tables[i, ps // bs] * bs + ps % bs
        k, v = cache[:hkv, slots].transpose(0, 1).float(), cache[hkv:, slots].transpose(0, 1).float()
        torch.testing.assert_close(outs[0][i], _dense(q[i], k, v, 0.21), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_attention_rounds_the_new_kv_as_torch_does(kv_dtype):
    """The C write's fp32 -> bf16 / fp16 rounding is torch's, bit for bit, over random bit
    patterns (every exponent: subnormals, overflow to inf, inf, nan) and the halfway cases."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-2**31, 2**31, (8192,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    ulp_half = {torch.bfloat16: 1 << 15, torch.float16: 1 << 12}[kv_dtype]  # halfway between two neighbours
    ties = (torch.randint(0, 2**23, (2048,), generator=g).to(torch.int32) & ~(2 * ulp_half - 1)) | ulp_half
    ties = (ties | (torch.randint(100, 160, (2048,), generator=g).to(torch.int32) << 23)).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65520.0, 65519.0, 6e-8,
                            3e-8, 2.9e-8, 1e-40, -1e-45, 3.4e38])
    values = torch.cat([x, ties, -ties, special])
    d = 16
    values = torch.cat([values, values.new_zeros((-values.numel()) % d)])
    n = values.numel() // d
    kv = torch.zeros(2, (n + 1) * 1, d, dtype=kv_dtype)
    for t in range(n):
        k_new = values[t * d:(t + 1) * d].view(1, 1, d)
        table = torch.tensor([[t + 1]])
        at = torch.tensor([0])
        cpu_ops.decode_attention(torch.zeros(1, 1, d), k_new, -k_new, kv, table, at, at, 1, 1.0)
    want = values.view(n, d).to(kv_dtype)
    got_k, got_v = kv[0, 1:], kv[1, 1:]
    nan = want.isnan()
    assert torch.equal(got_k.isnan(), nan) and torch.equal(got_v.isnan(), nan)
    assert torch.equal(got_k.view(torch.int16)[~nan], want.view(torch.int16)[~nan])  # signed zeros, infs too
    assert torch.equal(got_v.view(torch.int16)[~nan], (-values.view(n, d)).to(kv_dtype).view(torch.int16)[~nan])


def test_the_kernels_refuse_tensors_they_cannot_read():
    kv, tables, at = torch.zeros(2, 32, 8), torch.tensor([[1]]), torch.tensor([0])
    with pytest.raises(ValueError, match="expected torch.float32"):
        cpu_ops.decode_attention(torch.zeros(1, 1, 8), None, None, kv.double(), tables, at, at, 4, 1.0)
    with pytest.raises(ValueError, match="expected torch.float32"):
        cpu_ops.decode_attention(torch.zeros(1, 1, 8).bfloat16(), None, None, kv.bfloat16(), tables, at, at, 4, 1.0)
    with pytest.raises(ValueError, match="expected torch.int64"):
        cpu_ops.decode_attention(torch.zeros(1, 1, 8), None, None, kv, tables.int(), at, at, 4, 1.0)
    with pytest.raises(ValueError, match="unit strides"):
        cpu_ops.decode_attention(torch.zeros(1, 8, 2)[:, :, 0].unsqueeze(1), None, None, kv, tables, at, at, 4, 1.0)
    with pytest.raises(ValueError, match="expected torch.float32"):
        cpu_ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="scale must be"):
        cpu_ops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="cos / sin"):
        cpu_ops.rope_rotate_half(torch.zeros(1, 2, 8), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="halves"):
        cpu_ops.gated_act(torch.zeros(1, 7), "silu")
    q = torch.zeros(1, 1, 8)
    for bad in (
        dict(k_new=torch.zeros(1, 2, 8), v_new=torch.zeros(1, 2, 8)),  # more KV heads than the cache holds
        dict(k_new=torch.zeros(2, 1, 8), v_new=torch.zeros(2, 1, 8)),  # more rows than sequences
        dict(block_size=0),
        dict(kv=torch.zeros(0, 32, 8)),  # no KV heads
        dict(out=torch.zeros(1, 1, 4)),
        dict(out=torch.zeros(1, 1, 16)[:, :, ::2]),
    ):
        args = dict(q=q, k_new=None, v_new=None, kv=kv, tables=tables, first=at, pos=at, block_size=4, scale=1.0)
        with pytest.raises(ValueError, match="decode_attention"):
            cpu_ops.decode_attention(**{**args, **bad})
    with pytest.raises(ValueError, match="out must be"):
        cpu_ops.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6, out=torch.zeros(2, 7))


def test_decode_attention_refuses_positions_and_blocks_outside_its_tables():
    kv = torch.zeros(2, 8 * 4, 8)
    tables = torch.tensor([[1, 2]])
    q = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="outside its table"):
        cpu_ops.decode_attention(q, None, None, kv, tables, torch.tensor([0]), torch.tensor([8]), 4, 1.0)
    with pytest.raises(ValueError, match="outside its table"):
        cpu_ops.decode_attention(q, None, None, kv, tables, torch.tensor([-1]), torch.tensor([3]), 4, 1.0)
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_ops.decode_attention(q, None, None, kv, torch.tensor([[1, 8]]), torch.tensor([0]), torch.tensor([5]), 4, 1.0)
    with pytest.raises(ValueError, match="outside the pool"):  # (id + 1) * block_size would overflow
        cpu_ops.decode_attention(q, None, None, kv, torch.tensor([[2**62, 1]]), torch.tensor([0]), torch.tensor([5]),
                                 4, 1.0)


def test_auto_picks_the_cpu_kernels_for_quantized_models_only():
    assert resolve_backend("auto", "cpu") == "reference"  # the exact default
    assert resolve_backend("auto", "cpu", quantized=True) == "cpu"
    assert resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(InvalidConfigError, match="'cpu' cannot run here: it runs on a CPU, not cuda"):
        resolve_backend("cpu", "cuda")


def _run(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_without_the_kernels_the_engine_keeps_its_torch_path(tmp_path):
    code = (
        "from hybridkv.engine import cpu_ops; from hybridkv.engine.attention.registry import resolve_backend\n"
        "from hybridkv.errors import InvalidConfigError\n"
        "print(cpu_ops.load(), cpu_ops.unavailable(), resolve_backend('auto', 'cpu', quantized=True))\n"
        "try:\n    resolve_backend('cpu', 'cpu')\nexcept InvalidConfigError as e:\n    print('refused:', e)\n"
    )
    off = _run(code, HYBRIDKV_CPU_OPS="off")
    assert "None turned off (HYBRIDKV_CPU_OPS=off) reference" in off
    assert "refused: attention_backend 'cpu' cannot run here: turned off" in off
    if not fast_tier():  # a second child (seconds): the full suite only
        broken = _run(code, CC=str(tmp_path / "no-such-compiler"), HYBRIDKV_CACHE_DIR=str(tmp_path / "cache"))
        assert broken.startswith("None ") and "reference" in broken and "refused:" in broken


def test_a_quantized_engine_gives_the_reference_backends_tokens(tiny_models):
    """int8 Llama and Gemma 3, greedy: the fused kernels' rounding differs from torch's, not the tokens;
    every step's logits agree to 1e-4 relative (1e-3 where the matmuls round their rows to int16,
    the AVX2 build: a last-bit difference can move an input by one 2^-16 step of its block). The
    matmuls compute in fp32 here: with bf16 inputs (the default) a last-bit difference before a
    cast to bf16 can move an input by a bf16 step."""
    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.engine.models import load_model
    from hybridkv.sampling_params import SamplingParams

    for arch in ("llama", "gemma3"):
        path, _ = tiny_models(arch)
        model = load_model(path)
        model.quantize_weights("int8", compute_dtype=torch.float32)
        kinds = {type(m).__name__ for m in model.modules() if getattr(m, "cpu_kernels", False)}
        assert {"RMSNorm", "RotateHalf", "GatedActivation"} <= kinds, kinds  # norms, RoPE, the gated activation
        runs = {}
        for backend in ("reference", "cpu"):
            model.use_cpu_kernels(backend == "cpu")
            engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=96, max_model_len=96, quantization="int8",
                                                   attention_backend=backend))
            assert engine.attention_backend == backend
            for i, prompt in enumerate(([5, 9, 2, 7], list(range(3, 30)), [11] * 9)):
                engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True), request_id=f"r{i}")
            logits, tokens = [], {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.request_id] = out.output_token_ids
                engine.kv.check_invariants()
                logits.append({r: x.clone() for r, x in engine.runner.last_logits.items()})
            runs[backend] = (tokens, logits)
        assert runs["cpu"][0] == runs["reference"][0], arch
        tol = 1e-3 if cpu_ops.rounding_block() else 1e-4
        for ref, got in zip(runs["reference"][1], runs["cpu"][1]):
            for r in ref:
                rel = ((ref[r] - got[r]).norm() / ref[r].norm()).item()
                assert rel < tol, (arch, r, rel)


def test_a_build_prunes_modules_no_load_used_lately_and_old_leftovers(tmp_path):
    day = 86_400
    now = 1_000 * day
    suffix = ".cpython-311-x86_64-linux-gnu.so"

    def made(name: str, age_days: float):
        p = tmp_path / name
        p.write_bytes(b"x")
        os.utime(p, (now - age_days * day, now - age_days * day))
        return p

    keep = made(f"{cpu_ops.MODULE}-aaaa{suffix}", 400)  # the one just built / loaded: never removed
    recent = made(f"{cpu_ops.MODULE}-bbbb{suffix}", cpu_ops.PRUNE_AFTER_DAYS - 1)  # another venv's, in use
    old = made(f"{cpu_ops.MODULE}-cccc{suffix}", cpu_ops.PRUNE_AFTER_DAYS + 1)
    fresh_tmp = made(f"{cpu_ops.MODULE}-dddd{suffix}.tmp-123", 0.5)  # a build in progress
    old_tmp = made(f"{cpu_ops.MODULE}-eeee{suffix}.tmp-456", 2)
    other = made("unrelated.so", 999)
    removed = cpu_ops._prune(tmp_path, keep, now=now)
    assert sorted(removed) == sorted([old, old_tmp])
    assert all(p.exists() for p in (keep, recent, fresh_tmp, other)) and not old.exists() and not old_tmp.exists()
    assert cpu_ops._prune(tmp_path / "missing", keep, now=now) == []


def test_loading_marks_the_module_used(tmp_path):
    """A cached build is found, not rebuilt, and its time is renewed so that pruning keeps it."""
    cc = cpu_ops._compiler()
    path = cpu_ops._build(tmp_path, cc)
    os.utime(path, (1.0, 1.0))
    assert cpu_ops._build(tmp_path, cc) == path and path.stat().st_mtime > 1_000_000
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.slow
def test_a_module_pruned_between_the_check_and_the_load_is_built_again(tmp_path):
    code = (
        "from hybridkv.engine import cpu_ops\n"
        "from hybridkv.engine.cpu_ops import build\n"
        "real, calls = build._import, []\n"
        "def flaky(path):\n"
        "    calls.append(path)\n"
        "    if len(calls) == 1:\n"
        "        path.unlink(); raise ImportError('gone')  # another process's build pruned it\n"
        "    return real(path)\n"
        "build._import = flaky\n"
        "print(cpu_ops.load() is not None, len(calls), calls[-1].exists(), cpu_ops.unavailable())\n"
    )
    assert _run(code, HYBRIDKV_CACHE_DIR=str(tmp_path)) == "True 2 True None"


@pytest.mark.parametrize("seed", range(10))
def test_prune_removes_exactly_the_stale_modules_and_leftovers(tmp_path, seed):
    """Random names and ages around both limits: removed == (a module of ours, not the kept one,
    older than its limit); everything else stays."""
    import random

    rng = random.Random(seed)
    day, now = 86_400, 5_000 * 86_400
    limit = cpu_ops.PRUNE_AFTER_DAYS
    expected, files = set(), []
    for i in range(rng.randint(1, 12)):
        tmp = rng.random() < 0.4
        ours = rng.random() < 0.85
        name = (f"{cpu_ops.MODULE}-{i:04x}.so" if ours else f"other-{i}.so") + (f".tmp-{i}" if tmp else "")
        age = rng.choice([0.0, 0.9, 1.1, limit - 0.1, limit + 0.1, 2 * limit]) * day
        p = tmp_path / name
        p.write_bytes(b"x")
        os.utime(p, (now - age, now - age))
        files.append(p)
        if ours and (age > (day if tmp else limit * day)):
            expected.add(p)
    keep = rng.choice(files)
    expected.discard(keep)
    assert set(cpu_ops._prune(tmp_path, keep, now=now)) == expected
    assert {p for p in files if p.exists()} == set(files) - expected
