"""Weight-only quantization for CPU decode: int8 per output channel, int4 group-wise.

A decode step on a CPU reads every weight once, so its speed is the weights' bytes.
Quantized weights run through torch's own CPU kernels (as gpt-fast and torchao use them):

* ``int8``: ``w ~ q * s`` with ``q`` in [-127, 127] and one scale per output row
  (``s = max|w_row| / 127``); ``torch.ops.aten._weight_int8pack_mm``;
* ``int4``: per group of ``G`` input columns, ``w ~ q * s + min`` with ``q`` in [0, 15],
  ``s = (max - min) / 15``; stored as the kernel wants, ``(q - 8) * s + zero`` with
  ``zero = min + 8 s`` (``_convert_weight_to_int4pack_for_cpu``,
  ``_weight_int4pack_mm_for_cpu``). ``G`` is 32 (:data:`INT4_GROUP_SIZES`): llama.cpp's
  4-bit blocks (Q4_0/1, Q4_K) are 32 values on a 16-level grid, which groups of 32
  re-quantize almost as they were. Measured (greedy, 4 prompts x 48 tokens, tokens equal
  to fp32's before the first divergence): Gemma 3 270M (Q4_K_M) 3 of 192 with groups of
  128, 48 with 64 or 32; SmolLM2 (Q4_1) 1 with 64, 52 with 32; speed within noise.

Embeddings are quantized the same way and looked up row by row (``rows``); a tied output
projection shares them. The kernels take their inputs in a *compute dtype*, bf16 by default:
with fp32 inputs torch's CPU kernels are 10-40x slower (Gemma 3 270M's 262,144 x 640 output
projection for one token, 2 threads: int8 52 ms in fp32, 4.8 ms in bf16; int4 118 / 3.2 ms;
the bf16 dense matrix 11 ms). Activations between the matmuls and the KV cache stay in the
model dtype. Inputs of more than :data:`KERNEL_ROWS` rows (a prefill chunk) multiply the
weight dequantized to the compute dtype instead: there the kernels lose to a dense GEMM
(512 rows x 2048 x 640: int8 4.2 ms, dequantized + bf16 GEMM 1.9 ms).

Worked example (int8): a row ``[0.5, -1.27, 0.01]`` -> ``s = 0.01``, ``q = [50, -127, 1]``,
dequantized exactly.
"""

from __future__ import annotations

from typing import Iterable

import torch

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


def _rows_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [.., K] -> [M, K] in the kernels' compute ``dtype`` (no op where it already is)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == dtype else x2.to(dtype)


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
        self.shape = tuple(weight.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [.., K] -> [.., N] (computed in the scales' dtype, returned in x's)."""
        if bias is None and x.dim() == 2 and x.shape[0] <= KERNEL_ROWS:  # decode rows: the fewest calls
            out = torch.ops.aten._weight_int8pack_mm(x.to(self.scales.dtype), self.q, self.scales)
            return out.to(x.dtype)
        x2 = _rows_in(x, self.scales.dtype)  # [M, K]
        if x2.shape[0] > KERNEL_ROWS:
            out = torch.nn.functional.linear(x2, self.dense())
        else:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scales)  # [M, N]
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
        return self

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

    ``packed``: the matmul kernel's layout, rows padded to a multiple of 16 (None for a
    lookup-only embedding); ``nibbles`` [N, K/2] uint8 (codes of columns 2j, 2j+1 in the
    low, high nibble: embedding rows and the dense weight of large inputs);
    ``scales_zeros`` [K/G, N, 2] in the compute dtype.
    """

    quantized = True

    def __init__(self, weight: torch.Tensor, group: int, dtype: torch.dtype, matmul: bool = True) -> None:
        n, k = weight.shape
        if k % group:
            raise InvalidConfigError(f"int4 groups of {group} do not divide a {n} x {k} weight's {k} columns")
        w = weight.detach().float().view(n, k // group, group)
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [N, K/G]
        scales = ((hi - lo) / 15.0).clamp_(min=1e-12)
        codes = torch.round((w - lo.unsqueeze(2)) / scales.unsqueeze(2)).clamp_(0, 15).to(torch.int32).view(n, k)
        self.group = group
        self.shape = (n, k)
        self.scales_zeros = torch.stack([scales.t(), (lo + 8.0 * scales).t()], dim=2).to(dtype).contiguous()
        self.nibbles = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # rows and dense()
        self.packed = None
        if matmul:  # the kernel packs 16 rows at a time: pad with rows of code 8 (zero weight)
            pad = -n % 16
            if pad:
                codes = torch.cat([codes, codes.new_full((pad, k), 8)])
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
            sz = self.scales_zeros
            self._mm_scales_zeros = torch.cat([sz, sz.new_zeros(k // group, pad, 2)], dim=1) if pad else sz

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [.., K] -> [.., N] (computed in the scales' dtype, returned in x's)."""
        if bias is None and x.dim() == 2 and x.shape[0] <= KERNEL_ROWS and self._mm_scales_zeros.shape[1] == self.shape[0]:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(self.scales_zeros.dtype), self.packed, self.group, self._mm_scales_zeros
            )
            return out.to(x.dtype)
        x2 = _rows_in(x, self.scales_zeros.dtype)  # [M, K]
        if x2.shape[0] > KERNEL_ROWS:
            out = torch.nn.functional.linear(x2, self.dense())
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self._mm_scales_zeros)
            if out.shape[1] != self.shape[0]:  # rows padded to a multiple of 16
                out = out[:, : self.shape[0]]
        return _rows_out(out, x, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` [T] -> [T, K] (an embedding lookup), in the compute dtype."""
        return self._unpack(self.nibbles.index_select(0, ids), self.scales_zeros.index_select(1, ids))

    def dense(self) -> torch.Tensor:
        """[N, K] in the compute dtype."""
        return self._unpack(self.nibbles, self.scales_zeros)

    def _unpack(self, nib: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """nib [R, K/2] uint8, sz [K/G, R, 2] -> [R, K]: ``(code - 8) * scale + zero``."""
        rows = nib.shape[0]
        codes = torch.stack([nib & 15, nib >> 4], dim=2).view(rows, -1).to(sz.dtype)  # [R, K]
        codes = codes.view(rows, -1, self.group).sub_(8)  # [R, K/G, G]
        out = codes * sz[..., 0].t().unsqueeze(2) + sz[..., 1].t().unsqueeze(2)
        return out.view(rows, -1)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_tensors` needs (for the disk cache)."""
        out = {"nibbles": self.nibbles, "scales_zeros": self.scales_zeros}
        if self.packed is not None:
            out.update(packed=self.packed, mm_scales_zeros=self._mm_scales_zeros)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], group: int) -> "Int4Weight":
        self = cls.__new__(cls)
        self.nibbles, self.scales_zeros = tensors["nibbles"], tensors["scales_zeros"]
        self.packed = tensors.get("packed")
        self._mm_scales_zeros = tensors.get("mm_scales_zeros")
        n, half = self.nibbles.shape
        if self.nibbles.dtype != torch.uint8 or self.scales_zeros.shape != (2 * half // group, n, 2):
            raise ValueError("not an int4 weight")
        self.group, self.shape = group, (n, 2 * half)
        return self

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 as the matmul kernel sees the weight (its product with the identity)."""
        n, k = self.shape
        eye = torch.eye(k, dtype=self.scales_zeros.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self._mm_scales_zeros)
        return out[:, :n].t().float().contiguous()

    @property
    def nbytes(self) -> int:
        total = self.scales_zeros.numel() * self.scales_zeros.element_size()
        total += 0 if self.packed is None else self.packed.numel()
        return total + (0 if self.nibbles is None else self.nibbles.numel())


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


def quantize_weight(weight: torch.Tensor, mode: str, dtype: torch.dtype, group: int = 128,
                    matmul: bool = True) -> Int8Weight | Int4Weight:
    """``weight`` [N, K] quantized as ``mode`` (``"int8"`` / ``"int4"``), computed in ``dtype``
    (``matmul=False``: an embedding only looked up, no int4 kernel layout)."""
    check_quantization(mode, weight.device)
    if mode == "int8":
        return Int8Weight(weight, dtype)
    return Int4Weight(weight, group, dtype, matmul=matmul)
