"""Weight-only quantization for CPU decode: int8 per output channel, int4 group-wise.

A decode step on a CPU reads every weight once, so its speed is the weights' bytes:

* ``int8``: ``w ~ q * s`` with ``q`` in [-127, 127] and one scale per output row
  (``s = max|w_row| / 127``);
* ``int4``: per group of ``G`` input columns, ``w ~ q * s + min`` with ``q`` in [0, 15],
  ``s = (max - min) / 15``; stored as ``(q - 8) * s + zero`` with ``zero = min + 8 s`` (torch's
  int4 kernels' convention). ``G`` is 32 (:data:`INT4_GROUP_SIZES`): llama.cpp's 4-bit blocks
  (Q4_0/1, Q4_K) are 32 values on a 16-level grid, which groups of 32 re-quantize almost as
  they were, so greedy outputs follow fp32's longest with them; larger groups are no faster.

The matmuls of up to :data:`KERNEL_ROWS` rows (decode) run in the C kernels
(:func:`~hybridkv.engine.cpu_ops.q8_linear`, :func:`~hybridkv.engine.cpu_ops.q4_linear`): fp32
rows in, weights decoded in registers, split over the kernels' threads; with the *compute
dtype* bf16 (the default where the CPU has native bf16; fp32 elsewhere, the bf16 rule of
:mod:`~hybridkv.engine.cpu_ops.isa`) rows of 8 and more are rounded to bf16 and multiplied
with bf16 dot products (twice the products an instruction), fewer stay fp32 (their time is
the weight's bytes either way). On a CPU with AVX2 but no AVX-512 the fp32 rows are rounded
to 16-bit integers per block of 256 columns (2^-16 of the block's largest value, about 100
times finer than bf16) and the products summed exactly in integers, which reads the weights
at the memory's speed (:func:`~hybridkv.engine.cpu_ops.rounded_rows` states the rounding). Where the kernels cannot be built, torch's own kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, as gpt-fast and torchao use them)
take the rows in the compute dtype (their fp32 paths are far slower than their bf16 ones).
Inputs of more than :data:`KERNEL_ROWS` rows (a prefill chunk) multiply the weight dequantized
to the compute dtype instead: with that many rows a dense GEMM beats the weight-decoding
kernels, whose decoding is repeated per row.

Embeddings are quantized the same way and looked up row by row (``rows``); a tied output
projection shares them. Activations between the matmuls and the KV cache stay in the model
dtype.

Worked example (int8): a row ``[0.5, -1.27, 0.01]`` -> ``s = 0.01``, ``q = [50, -127, 1]``,
dequantized exactly.
"""

from __future__ import annotations

from typing import Iterable

import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine_config import QUANTIZATIONS
from hybridkv.errors import InvalidConfigError

__all__ = [
    "QUANTIZATIONS", "INT4_GROUP_SIZES", "Int8Weight", "Int4Weight", "check_quantization", "quantize_weight",
    "int4_group_size",
]

#: int4 group sizes, preferred first (the first that divides every input size is used)
INT4_GROUP_SIZES = (32, 64, 128)
#: inputs of more rows than this run on the dequantized weight (a dense GEMM)
KERNEL_ROWS = 32


def _rows_in(x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x2 [M, K] in the kernels' compute ``dtype`` (no op where it already is)."""
    return x2 if x2.dtype == dtype else x2.to(dtype)


#: the compute dtypes whose scales the C kernels read (others, e.g. fp16: torch's kernels)
_C_SCALES = (torch.bfloat16, torch.float32)


def _c_rows(x2: torch.Tensor) -> bool:
    """Whether the C kernels take rows ``x2`` [M, K]: fp32 on the CPU, unit stride in K, kernels built."""
    return x2.dtype == torch.float32 and x2.stride(1) == 1 and x2.is_cpu and cpu_ops.load() is not None


def _rows_out(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out [M, N] -> [.., N] in ``x``'s dtype, ``bias`` added."""
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


class Int8Weight:
    """``[N, K]`` as int8 ``q`` and per-row ``scales`` [N] (in the activation dtype)."""

    quantized = True

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        w = weight.detach().float()  # [N, K]
        scales = (w.abs().amax(dim=1) / 127.0).clamp_(min=1e-12)  # [N]
        self.q = torch.round(w / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(dtype)
        self.scales32 = self.scales.float()  # [N] for the C kernels
        self.shape = tuple(weight.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [.., K] -> [.., N] (returned in x's dtype): up to :data:`KERNEL_ROWS` fp32 rows in the C
        kernel (see the module docstring for its precision), else torch's kernel in the scales'
        dtype; more rows on the dense weight."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]
        if x2.shape[0] <= KERNEL_ROWS:
            if _c_rows(x2):
                out = cpu_ops.q8_linear(x2, self.q, self.scales32, self.scales.dtype == torch.bfloat16)
            else:
                out = torch.ops.aten._weight_int8pack_mm(_rows_in(x2, self.scales.dtype), self.q, self.scales)  # [M, N]
        else:
            out = torch.nn.functional.linear(_rows_in(x2, self.scales.dtype), self.dense())
        return _rows_out(out, x, bias)

    def dense(self) -> torch.Tensor:
        """[N, K] in the compute dtype."""
        return self.q.to(self.scales.dtype) * self.scales.unsqueeze(1)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_tensors` needs (for the disk cache)."""
        return {"q": self.q, "scales": self.scales}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], group: int = 0) -> "Int8Weight":
        self = cls.__new__(cls)
        self.q, self.scales = tensors["q"], tensors["scales"]
        if self.q.dtype != torch.int8 or self.q.dim() != 2 or self.scales.shape != (self.q.shape[0],):
            raise ValueError("not an int8 weight")
        self.shape = tuple(self.q.shape)
        self.scales32 = self.scales.float()
        return self

    def kernel_fields(self) -> tuple[int, ...] | None:
        """What the C kernels read (cpu_ops.h ``qweight``): kind 1, q, fp32 scales, -, inputs in
        bf16, N, K."""
        if not self.q.is_contiguous():
            return None
        return (1, self.q.data_ptr(), self.scales32.data_ptr(), 0, int(self.scales.dtype == torch.bfloat16), *self.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` [T] -> [T, K] (an embedding lookup)."""
        return self.q.index_select(0, ids).to(self.scales.dtype) * self.scales.index_select(0, ids).unsqueeze(1)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float().unsqueeze(1)  # [N, K] fp32

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


class Int4Weight:
    """``[N, K]`` in groups of ``group`` columns: 4-bit codes, a scale and a zero per group.

    ``nibbles`` [N, K/2] uint8 (codes of columns 2j, 2j+1 in the low, high nibble) and
    ``scales_zeros`` [N, K/G, 2] in the compute dtype: what the C kernels multiply by
    (:func:`~hybridkv.engine.cpu_ops.q4_linear`), embedding rows and the dense weight of large
    inputs; ``packed`` and its ``[K/G, N_16, 2]`` scales: torch's kernel's layout, rows padded to
    a multiple of 16 (:meth:`torch_layout`, made when first used: where the C kernels cannot be).
    """

    quantized = True

    def __init__(self, weight: torch.Tensor, group: int, dtype: torch.dtype) -> None:
        n, k = weight.shape
        if k % group:
            raise InvalidConfigError(f"int4 groups of {group} do not divide a {n} x {k} weight's {k} columns")
        w = weight.detach().float().view(n, k // group, group)
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [N, K/G]
        scales = ((hi - lo) / 15.0).clamp_(min=1e-12)
        codes = torch.round((w - lo.unsqueeze(2)) / scales.unsqueeze(2)).clamp_(0, 15).to(torch.int32).view(n, k)
        self.group = group
        self.shape = (n, k)
        self.scales_zeros = torch.stack([scales, lo + 8.0 * scales], dim=2).to(dtype).contiguous()  # [N, K/G, 2]
        self.nibbles = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()
        self.packed = self._mm_scales_zeros = None

    def torch_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, scales_zeros)`` as ``_weight_int4pack_mm_for_cpu`` takes them (made once):
        the kernel packs 16 rows at a time, so rows of code 8 (zero weight) pad N."""
        if self.packed is None:
            n, k = self.shape
            codes = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=2).view(n, k).to(torch.int32)
            pad = -n % 16
            if pad:
                codes = torch.cat([codes, codes.new_full((pad, k), 8)])
            sz = self.scales_zeros.transpose(0, 1)  # [K/G, N, 2]
            self._mm_scales_zeros = torch.cat([sz, sz.new_zeros(k // self.group, pad, 2)], dim=1).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        return self.packed, self._mm_scales_zeros

    def kernel_fields(self) -> tuple[int, ...] | None:
        """What the C kernels read (cpu_ops.h ``qweight``): kind 2, nibbles, scales and zeros, G,
        whether they are bf16, N, K (None: scales in a dtype the kernels do not read)."""
        sz = self.scales_zeros
        if sz.dtype not in _C_SCALES or not sz.is_contiguous() or not self.nibbles.is_contiguous():
            return None
        return (2, self.nibbles.data_ptr(), sz.data_ptr(), self.group, int(sz.dtype == torch.bfloat16), *self.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [.., K] -> [.., N] (returned in x's dtype): up to :data:`KERNEL_ROWS` fp32 rows in the C
        kernel (see the module docstring for its precision), else torch's kernel in the scales'
        dtype; more rows on the dense weight."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]
        if x2.shape[0] <= KERNEL_ROWS:
            if _c_rows(x2) and self.scales_zeros.dtype in _C_SCALES:
                out = cpu_ops.q4_linear(x2, self.nibbles, self.scales_zeros, self.group)
            else:
                packed, sz = self.torch_layout()
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(sz.dtype), packed, self.group, sz)
                if out.shape[1] != self.shape[0]:  # rows padded to a multiple of 16
                    out = out[:, : self.shape[0]]
        else:
            out = torch.nn.functional.linear(_rows_in(x2, self.scales_zeros.dtype), self.dense())
        return _rows_out(out, x, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` [T] -> [T, K] (an embedding lookup), in the compute dtype."""
        return self._unpack(self.nibbles.index_select(0, ids), self.scales_zeros.index_select(0, ids))

    def dense(self) -> torch.Tensor:
        """[N, K] in the compute dtype."""
        return self._unpack(self.nibbles, self.scales_zeros)

    def _unpack(self, nib: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """nib [R, K/2] uint8, sz [R, K/G, 2] -> [R, K]: ``(code - 8) * scale + zero``."""
        rows = nib.shape[0]
        codes = torch.stack([nib & 15, nib >> 4], dim=2).view(rows, -1).to(sz.dtype)  # [R, K]
        codes = codes.view(rows, -1, self.group).sub_(8)  # [R, K/G, G]
        out = codes * sz[..., 0:1] + sz[..., 1:2]
        return out.view(rows, -1)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_tensors` needs (for the disk cache)."""
        return {"nibbles": self.nibbles, "scales_zeros": self.scales_zeros}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], group: int) -> "Int4Weight":
        self = cls.__new__(cls)
        self.nibbles, self.scales_zeros = tensors["nibbles"], tensors["scales_zeros"]
        self.packed = self._mm_scales_zeros = None
        n, half = self.nibbles.shape
        if self.nibbles.dtype != torch.uint8 or group < 1 or self.scales_zeros.shape != (n, 2 * half // group, 2):
            raise ValueError("not an int4 weight")
        self.group, self.shape = group, (n, 2 * half)
        return self

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32: ``(code - 8) * scale + zero`` from the stored scales and zeros, in fp32."""
        return self._unpack(self.nibbles, self.scales_zeros.float())

    @property
    def nbytes(self) -> int:
        total = self.scales_zeros.numel() * self.scales_zeros.element_size() + self.nibbles.numel()
        if self.packed is not None:
            total += self.packed.numel() + self._mm_scales_zeros.numel() * self._mm_scales_zeros.element_size()
        return total


def int4_group_size(in_features: Iterable[int]) -> int:
    """The first of :data:`INT4_GROUP_SIZES` that divides every input size; InvalidConfigError if none."""
    sizes = sorted(set(in_features))
    for g in INT4_GROUP_SIZES:
        if all(k % g == 0 for k in sizes):
            return g
    raise InvalidConfigError(
        f"int4 quantization needs every weight's input size to be a multiple of {min(INT4_GROUP_SIZES)}; "
        f"this model has "
        f"{', '.join(str(k) for k in sizes if k % 32)}: use --quantization int8"
    )


def check_quantization(quantization: str | None, device: str | torch.device = "cpu") -> None:
    """Refuse (InvalidConfigError) a quantization that is unknown or cannot run on ``device``
    (None, no quantization, always can)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise InvalidConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if torch.device(device).type != "cpu":
        raise InvalidConfigError(f"weight-only quantization runs on a CPU (torch's kernels), not {device}")


def quantize_weight(weight: torch.Tensor, mode: str, dtype: torch.dtype, group: int = 128) -> Int8Weight | Int4Weight:
    """``weight`` [N, K] quantized as ``mode`` (``"int8"`` / ``"int4"``), computed in ``dtype``."""
    check_quantization(mode, weight.device)
    if mode not in ("int8", "int4"):
        raise InvalidConfigError(f"{mode} weights are not made by quantizing a tensor (gguf: a GGUF file's own blocks)")
    if mode == "int8":
        return Int8Weight(weight, dtype)
    return Int4Weight(weight, group, dtype)
