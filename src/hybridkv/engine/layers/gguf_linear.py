"""A weight held in a GGUF file's own blocks, run as it is stored (``--quantization auto`` on a CPU).

A GGUF checkpoint's matrices are already quantized (Q4_K_M files hold Q4_K, Q5_0, Q6_K and
Q8_0 tensors; SmolLM2's Q4_1 and Q8_0): :class:`GGUFWeight` keeps those bytes and multiplies
by them in the C kernels (:func:`~hybridkv.engine.cpu_ops.gguf_linear`, ``gguf_blocks.c``),
decoding each block in registers; the activations stay fp32. Its values are exactly the
dequantization the ``none`` path loads (gguf's own ``dequantize``), so the product differs from
``none``'s only by the order of the fp32 sums. No dequantized copy is kept:

* up to :data:`KERNEL_ROWS` rows (decode steps, the fused decode step, the last rows of a
  prefill) run in the kernels;
* more rows (a prefill chunk) multiply slices of at most :data:`DENSE_SLICE` weights, each
  dequantized just before its GEMM and dropped after;
* :meth:`rows` dequantizes the rows of an embedding lookup.

A fused matrix whose parts the file stores in different types (Gemma 3's q / k in Q5_0, v in
Q8_0) is a list of *segments*: runs of output rows, one block type each (:meth:`cat`).

Worked example (Q8_0, 32 weights a block of 34 bytes): a [1024, 640] weight is 20 blocks a
row, 680 bytes; the segment table row is ``(8, 1024, address, 680)``.

Where the C kernels cannot be built, gguf's Python dequantizer gives the slices instead
(correct, slower); the loader then keeps ``auto`` off (:func:`native_available`).
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridkv.engine import cpu_ops

__all__ = ["BLOCK_TYPES", "DENSE_SLICE", "NATIVE_TYPES", "KERNEL_ROWS", "GGUFWeight", "block_type", "native_available"]

#: the types the kernels read (gguf_blocks.h's GGUF_TYPES), by ggml name
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
#: ggml type name -> (type id, values per block, bytes per block), from gguf's own table
BLOCK_TYPES = {name: (int(GGMLQuantizationType[name]), *GGML_QUANT_SIZES[GGMLQuantizationType[name]])
               for name in NATIVE_TYPES}
_BY_ID = {v[0]: (name, *v[1:]) for name, v in BLOCK_TYPES.items()}
#: inputs of up to this many rows run in the kernels (as the int8 / int4 weights)
KERNEL_ROWS = 32
#: more rows multiply slices of at most this many weights, dequantized one at a time
DENSE_SLICE = 1 << 22


def block_type(type_name: str, k: int) -> tuple[int, int, int] | None:
    """``(type id, values per block, bytes per block)`` of ggml type ``type_name`` when the kernels
    read it for rows of ``k`` values (a whole number of blocks), else None.

    >>> block_type("Q4_K", 1024), block_type("Q4_K", 640), block_type("F32", 640)
    ((12, 256, 144), None, None)
    """
    t = BLOCK_TYPES.get(type_name)
    return t if t is not None and k % t[1] == 0 else None


def native_available() -> bool:
    """Whether GGUF blocks run natively here: the C kernels build."""
    return cpu_ops.load() is not None


_buffers = threading.local()


def _slice_buffer(numel: int) -> torch.Tensor:
    """A reused fp32 buffer of at least ``numel`` (at most :data:`DENSE_SLICE`) values for the
    slices :meth:`GGUFWeight.linear` dequantizes: fresh memory per slice would fault in its pages
    each time. One per thread (engines stepping in two threads never share one)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _buffers.buf = torch.empty(max(numel, min(DENSE_SLICE, 1 << 20)), dtype=torch.float32)
    return buf[:numel]


class GGUFWeight:
    """``[N, K]`` as GGUF blocks: ``parts`` of ``(ggml type id, data uint8 [rows, row bytes])``,
    output rows in order. The data are held (the kernels read their addresses)."""

    quantized = True

    def __init__(self, parts: Sequence[tuple[int, torch.Tensor]], k: int) -> None:
        if not parts:
            raise ValueError("a GGUF weight needs at least one part")
        table = []
        for type_id, data in parts:
            if type_id not in _BY_ID:
                raise ValueError(f"ggml type {type_id} is not one the kernels read")
            _, qk, nbytes = _BY_ID[type_id]
            if (k % qk or data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != k // qk * nbytes
                    or not data.is_contiguous() or not data.is_cpu):
                raise ValueError(f"a {_BY_ID[type_id][0]} part of rows of {k} must be uint8 [rows, {k // qk * nbytes}] "
                                 f"contiguous on the CPU, got {tuple(data.shape)} {data.dtype}")
            table.append((type_id, data.shape[0], data.data_ptr(), data.shape[1]))
        self.parts = list(parts)
        self.segments = torch.tensor(table, dtype=torch.int64)  # [S, 4]: type, rows, address, row bytes
        self.shape = (sum(d.shape[0] for _, d in parts), k)

    @classmethod
    def cat(cls, weights: Sequence["GGUFWeight"]) -> "GGUFWeight":
        """The weights' rows one after another (a fused q / k / v or gate / up matrix)."""
        k = weights[0].shape[1]
        if any(w.shape[1] != k for w in weights):
            raise ValueError("GGUF weights joined by rows need one input size")
        return cls([p for w in weights for p in w.parts], k)

    @property
    def type_names(self) -> tuple[str, ...]:
        """Each segment's ggml type name."""
        return tuple(_BY_ID[t][0] for t, _ in self.parts)

    def kernel_fields(self) -> tuple[int, ...]:
        """What the C kernels read (cpu_ops.h ``qweight``): kind 3, the segment table, -, its rows,
        -, N, K."""
        return (3, self.segments.data_ptr(), 0, self.segments.shape[0], 0, *self.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [.., K] -> [.., N] in x's dtype: up to :data:`KERNEL_ROWS` fp32 rows in the kernels,
        more rows on dequantized slices (fp32 GEMMs)."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]
        rows = x2.float() if x2.dtype != torch.float32 else x2
        if x2.shape[0] <= KERNEL_ROWS and rows.stride(1) == 1 and rows.is_cpu and native_available():
            out = cpu_ops.gguf_linear(rows, self.segments, *self.shape)
        else:
            out = self._sliced(rows)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def _sliced(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N]: slices of output rows dequantized one at a time."""
        n, k = self.shape
        step = max(1, DENSE_SLICE // k)
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        native = native_available()
        for n0 in range(0, n, step):
            ids = torch.arange(n0, min(n, n0 + step))
            if native:  # the kernels' threads decode the slice into the reused buffer, torch's multiply it
                cpu_ops.hold_cores(True)
                w = cpu_ops.gguf_rows(self.segments, n, k, ids=ids, out=_slice_buffer(ids.shape[0] * k).view(-1, k))
                cpu_ops.hold_cores(False)
            else:
                w = self._python_rows(ids)
            out[:, n0 : n0 + ids.shape[0]] = torch.nn.functional.linear(x, w)  # [M, slice]
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` [T] -> [T, K] fp32 (an embedding lookup): gguf's values."""
        ids = ids.to(torch.int64)
        if native_available():
            return cpu_ops.gguf_rows(self.segments, *self.shape, ids=ids)
        return self._python_rows(ids)

    def _python_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`rows` by gguf's own dequantizer (where the kernels cannot be built)."""
        from gguf.quants import dequantize

        n, k = self.shape
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"rows outside [0, {n})")
        out = torch.empty((ids.shape[0], k), dtype=torch.float32)
        start = 0
        for type_id, data in self.parts:
            rows = data.shape[0]
            hit = ((ids >= start) & (ids < start + rows)).nonzero().flatten()
            if hit.numel():
                raw = data.index_select(0, ids[hit] - start).numpy()
                out[hit] = torch.from_numpy(dequantize(raw, type_id).reshape(-1, k).copy())
            start += rows
        return out

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32: every row (tests, comparisons; the engine never holds this)."""
        return self.rows(torch.arange(self.shape[0]))

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.parts)
