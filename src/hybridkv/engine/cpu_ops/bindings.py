"""The typed Python wrappers of the fused CPU kernels: each checks its tensors' dtypes, devices,
shapes and strides (ValueError, before any raw memory is read), allocates the output and passes
``data_ptr()`` values and element strides to the compiled module (:func:`load`, which builds it
on first use). Shapes are in each wrapper's docstring; all fp32 unless stated. The results
differ from torch's by float rounding (another summation order, a polynomial ``exp``), except
:func:`rope_rotate_half`, which is bit for bit the torch ops'.
"""

from __future__ import annotations

import torch

from hybridkv.engine.cpu_ops.build import _state, load

__all__ = ["ACTIVATIONS", "KV_TYPES", "decode_attention", "gated_act", "gguf_linear", "gguf_rows", "hold_cores", "q4_linear",
           "q8_linear", "rms_norm", "rope_rotate_half", "rounded_rows", "rounding_block"]


def hold_cores(kernels: bool) -> None:
    """Hand the process's cores to the kernels (``True``: the quantized matmuls split over them,
    torch's ops run on one thread) or to torch (``False``: torch's threads as they were, the
    kernels on one). Two thread pools spinning for one core stall each other for a scheduler
    slice, so one of them holds the cores: the kernels in decode steps (small torch ops), torch
    in prefill (its GEMMs and attention). Sticky: a no-op when the cores are already where asked."""
    if kernels == _state.get("kernels", False) or load() is None:
        return
    if kernels:
        threads = torch.get_num_threads()
        _state["torch_threads"] = threads
        torch.set_num_threads(1)
        _state["module"].set_threads(threads)
    else:
        _state["module"].set_threads(1)
        torch.set_num_threads(_state.get("torch_threads", torch.get_num_threads()))
    _state["kernels"] = kernels


def _check(*tensors: torch.Tensor | None, dtype: torch.dtype) -> None:
    """The kernels read raw memory: refuse (ValueError) what they cannot read as ``dtype`` rows."""
    for x in tensors:
        if x is not None and (x.dtype is not dtype or not x.is_cpu or x.stride(-1) != 1):
            raise ValueError(f"cpu_ops: expected {dtype} CPU tensors with unit stride in the last dim, got "
                             f"{x.dtype} on {x.device} with strides {x.stride()}")


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., D] or [T, H, D] fp32 (unit stride in D) -> [same shape] fp32 contiguous:
    ``x / sqrt(mean(x^2) + eps) * scale``, scale [D] or [H, D] fp32 contiguous (per head)."""
    ops = load()
    _check(x, scale, dtype=torch.float32)
    d = x.shape[-1]
    if not scale.is_contiguous() or scale.shape[-1] != d:
        raise ValueError("rms_norm: scale must be [D] or [H, D] contiguous")
    if x.dim() == 3:
        t, h = x.shape[0], x.shape[1]
        st, sh = x.stride(0), x.stride(1)
    else:
        x = x.reshape(-1, d) if x.dim() != 2 else x
        t, h, st, sh = x.shape[0], 1, x.stride(0), 0
    rows = 1 if scale.dim() == 1 else scale.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    elif out.shape != x.shape or out.dtype is not torch.float32 or not out.is_contiguous():
        raise ValueError("rms_norm: out must be fp32 contiguous in x's shape")
    ops.rms_norm(x.data_ptr(), out.data_ptr(), scale.data_ptr(), t, h, d, st, sh, rows, eps)
    return out


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] fp32 (unit stride in D), cos / sin [T, 1, D] fp32 (the rotary embedding's
    ``cos_sin`` rows, contiguous; sin carries the sign) -> [T, H, D] contiguous: the rotate-half
    RoPE's torch ops ``x * cos + x.roll(D/2, -1) * sin``, bit for bit (each product and the sum
    rounded alone)."""
    _check(x, cos, sin, dtype=torch.float32)
    t, h, d = x.shape
    if not (cos.shape == sin.shape == (t, 1, d) and cos.stride() == sin.stride() and cos.is_contiguous()):
        raise ValueError("rope_rotate_half: cos / sin must be [T, 1, D] contiguous")
    out = torch.empty((t, h, d), dtype=torch.float32)
    load().rope_rotate_half(x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, h, d, x.stride(0),
                            x.stride(1), cos.stride(0))
    return out


#: :func:`gated_act`'s activations (their kernel codes)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [T, 2I] fp32 (unit stride in the last dim) -> [T, I]: ``act(gate) * up``, ``act``
    one of :data:`ACTIVATIONS` (silu; gelu with the tanh approximation)."""
    _check(gate_up, dtype=torch.float32)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError("gated_act: gate_up must hold gate and up halves of one size")
    out = torch.empty((t, two_i // 2), dtype=torch.float32)
    load().gated_act(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, gate_up.stride(0), ACTIVATIONS[act])
    return out


#: the KV cache element types the C attention reads and writes (attn_job.kv_type)
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv: torch.Tensor,
    tables: torch.Tensor,
    first: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence through its block table. q [S, Hq, D]; k_new / v_new [S, Hkv, D]
    (written at position ``pos[s]`` first, rounded to the cache's dtype as ``.to(dtype)`` rounds;
    None: nothing written); kv [2 Hkv, num_slots, D] contiguous (keys, then values) in fp32, bf16
    or fp16 (:data:`KV_TYPES`); tables [S, W] int64 (rows contiguous); first / pos [S] int64:
    sequence s attends to positions first[s] .. pos[s]. q, k_new, v_new and out fp32, unit stride
    in D. Scores and sums in fp32 over the stored values. Returns out [S, Hq, D] contiguous."""
    ops = load()
    s, hq, d = q.shape
    hkv = kv.shape[0] // 2
    f32, i64 = torch.float32, torch.int64
    kv_type = KV_TYPES.get(kv.dtype)
    if (q.dtype is not f32 or kv_type is None or tables.dtype is not i64 or first.dtype is not i64
            or pos.dtype is not i64 or not (q.is_cpu and kv.is_cpu and tables.is_cpu and first.is_cpu and pos.is_cpu)
            or (k_new is not None and (k_new.dtype is not f32 or v_new.dtype is not f32 or not k_new.is_cpu
                                       or not v_new.is_cpu))):
        _check(q, k_new, v_new, dtype=f32)  # raises, naming the tensor's dtype
        _check(kv, dtype=kv.dtype if kv_type is not None else f32)
        _check(tables, first, pos, dtype=i64)
    if (q.stride(2) != 1 or not kv.is_contiguous() or kv.dim() != 3 or kv.shape[2] != d or hkv < 1 or hq % hkv
            or tables.dim() != 2 or tables.shape[0] < s or tables.stride(1) != 1 or first.shape != (s,)
            or pos.shape != (s,) or not first.is_contiguous() or not pos.is_contiguous() or block_size < 1
            or (k_new is not None and (k_new.stride(2) != 1 or k_new.shape != (s, hkv, d) or k_new.shape != v_new.shape))
            or (out is not None and (out.shape != (s, hq, d) or out.dtype is not f32 or not out.is_contiguous()))):
        raise ValueError("decode_attention: q [S, Hq, D], k_new / v_new [S, Hkv, D] and kv [2 Hkv, slots, D] "
                         "contiguous (Hq a multiple of Hkv), tables [>= S, W] and first / pos [S] contiguous int64, "
                         "unit strides in D, block size >= 1, out [S, Hq, D] fp32 contiguous")
    out = torch.empty((s, hq, d), dtype=torch.float32) if out is None else out
    if k_new is None:
        kp = vp = 0
        ns = nh = 0
    else:
        if k_new.stride() != v_new.stride():
            v_new = v_new.contiguous()
            k_new = k_new.contiguous()
        kp, vp = k_new.data_ptr(), v_new.data_ptr()
        ns, nh = k_new.stride(0), k_new.stride(1)
    ops.decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), kp, vp, ns, nh, kv.data_ptr(), kv.shape[1], hkv, d,
        hq // hkv, tables.data_ptr(), tables.stride(0), tables.shape[1], first.data_ptr(), pos.data_ptr(), s, block_size,
        scale, out.data_ptr(), kv_type,
    )
    return out


def rounding_block(group: int = 0) -> int:
    """The columns per rounding step of the rows the quantized matmuls round to 16-bit integers
    (the AVX2 build, ``qmatmul_avx2.c``): 256, for int4 (``group`` > 0) the multiple of the
    group from 256 up (the group itself past 256); 0 where the rows stay fp32 (AVX-512, plain C,
    no kernels)."""
    block = getattr(load(), "X16_BLOCK", 0)
    if not block or group <= 0:
        return block
    return group if group >= block else -(-block // group) * group


def rounded_rows(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """x [M, K] fp32 -> [M, K] fp64: the rows as the quantized matmuls of this build multiply
    them (``group``: the int4 weight's group, 0 for int8), x itself where they stay fp32. The
    AVX2 rounding, in torch's fp32 arithmetic as the C does it: per row and block of
    :func:`rounding_block` columns, ``amax = max|x|``, ``x16 = round(x * (32767 / amax))`` (half
    to even), ``x ~ x16 * (amax / 32767)``; a block with a nan or an inf gives nan, one of zeros
    zeros. Worked example: ``[0.5, -1.0, 0.25]`` -> ``[16384, -32767, 8192] / 32767``."""
    block = rounding_block(group)
    if not block:
        return x.double()
    out = torch.empty(x.shape, dtype=torch.float64)
    for k0 in range(0, x.shape[1], block):
        part = x[:, k0 : k0 + block].float()
        amax = part.abs().amax(dim=1, keepdim=True) if part.shape[1] else part.new_zeros(part.shape[0], 1)
        finite = torch.isfinite(amax) & ~part.isnan().any(dim=1, keepdim=True)
        inv = torch.where(finite & (amax > 0), torch.tensor(32767.0) / amax, torch.zeros_like(amax))
        step = torch.where(finite, amax / torch.tensor(32767.0), torch.full_like(amax, float("nan")))
        out[:, k0 : k0 + block] = torch.round(part * inv).double() * step.double()
    return out


def _linear_rows(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """x [M, K] fp32 with unit stride in K (rows at any stride), else ValueError."""
    if x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{what}: x must be [M, {k}] fp32 on the CPU with unit stride in K, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    return x


def q8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """x [M, K] fp32 (unit stride in K) times the int8 weight ``q`` [N, K] (contiguous) with
    per-row ``scales`` [N] fp32 -> [M, N] fp32: ``y[m, n] = scales[n] * sum_k x[m, k] q[n, k]``,
    split over the kernels' threads; ``bf16``: x rounded to bf16 first (bf16 dot products);
    on AVX2 x is rounded as :func:`rounded_rows` says."""
    n, k = q.shape
    _linear_rows(x, k, "q8_linear")
    if q.dtype is not torch.int8 or not q.is_contiguous() or scales.dtype is not torch.float32 \
            or scales.shape != (n,) or not scales.is_contiguous() or not (q.is_cpu and scales.is_cpu):
        raise ValueError("q8_linear: q must be [N, K] int8 contiguous and scales [N] fp32 contiguous")
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    load().q8_linear(x.data_ptr(), x.stride(0), x.shape[0], k, q.data_ptr(), scales.data_ptr(), n,
                     out.data_ptr(), n, bool(bf16))
    return out


def q4_linear(x: torch.Tensor, nibbles: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] fp32 (unit stride in K) times the int4 weight (``nibbles`` [N, K/2] uint8: column
    2j's code in byte j's low nibble, 2j+1's in its high one; ``scales_zeros`` [N, K/G, 2] bf16 or
    fp32, contiguous) -> [M, N] fp32: weights ``(code - 8) * scale + zero`` per group of ``group``
    (a multiple of 32) columns, split over the kernels' threads. With bf16 scales the inputs and
    the weights are rounded to bf16 (bf16 dot products), with fp32 ones they stay fp32 (on AVX2
    rounded as :func:`rounded_rows` says)."""
    n, half = nibbles.shape
    k = 2 * half
    _linear_rows(x, k, "q4_linear")
    sz = scales_zeros
    if (nibbles.dtype is not torch.uint8 or not nibbles.is_contiguous() or not nibbles.is_cpu
            or group < 32 or group % 32 or k % group or sz.shape != (n, k // group, 2) or not sz.is_contiguous()
            or sz.dtype not in (torch.bfloat16, torch.float32) or not sz.is_cpu):
        raise ValueError("q4_linear: nibbles [N, K/2] uint8 and scales_zeros [N, K/G, 2] bf16 / fp32 contiguous, "
                         "K a multiple of the group, the group a multiple of 32")
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    load().q4_linear(x.data_ptr(), x.stride(0), x.shape[0], k, nibbles.data_ptr(), sz.data_ptr(),
                     sz.dtype is torch.bfloat16, group, n, out.data_ptr(), n)
    return out


def _segments(segments: torch.Tensor) -> None:
    if segments.dtype is not torch.int64 or not segments.is_contiguous() or segments.dim() != 2 \
            or segments.shape[1] != 4 or not segments.is_cpu:
        raise ValueError("gguf: segments must be an int64 [S, 4] contiguous CPU tensor")


def gguf_linear(x: torch.Tensor, segments: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """x [M, K] fp32 (unit stride in K) times a weight [N, K] held in GGUF blocks -> [M, N] fp32.
    ``segments`` int64 [S, 4]: per run of output rows its ggml type, its row count, its data's
    address and its bytes per row (``gguf_blocks.c``; the caller keeps the data alive). The
    inputs stay fp32; per sub-block ``a * (q . x) + c * sum(x)``, the dequantized weight's
    product up to the order of the fp32 sums. ValueError when the segments do not fit together."""
    _linear_rows(x, k, "gguf_linear")
    _segments(segments)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    load().gguf_linear(x.data_ptr(), x.stride(0), x.shape[0], k, segments.data_ptr(), segments.shape[0], n,
                       out.data_ptr(), n)
    return out


def gguf_rows(segments: torch.Tensor, n: int, k: int, ids: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` [T] int64 (None: all N) of a weight [N, K] in GGUF blocks (see
    :func:`gguf_linear`), dequantized -> [T, K] fp32 (``out`` when given: contiguous fp32 of that
    shape): the values gguf's own dequantizer gives, bit for bit. IndexError for an id outside
    [0, N)."""
    _segments(segments)
    if ids is not None and (ids.dtype is not torch.int64 or ids.dim() != 1 or not ids.is_cpu):
        raise ValueError("gguf_rows: ids must be an int64 [T] CPU tensor")
    if ids is not None and not ids.is_contiguous():
        ids = ids.contiguous()
    t = n if ids is None else ids.shape[0]
    if out is None:
        out = torch.empty((t, k), dtype=torch.float32)
    elif out.shape != (t, k) or out.dtype is not torch.float32 or not out.is_contiguous():
        raise ValueError(f"gguf_rows: out must be [{t}, {k}] fp32 contiguous")
    load().gguf_rows(segments.data_ptr(), segments.shape[0], n, k, 0 if ids is None else ids.data_ptr(), t,
                     out.data_ptr())
    return out
