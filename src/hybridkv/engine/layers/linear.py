"""Linear layers for inference: fused projections and prepacked CPU weights.

* :func:`fuse_linears` - linears on the same input (q/k/v, gate/up) become one
  matmul; their parameters turn into views of the fused weight, so names,
  ``state_dict`` and memory stay as loaded.
* :class:`PackedWeight` - on CPU in fp32, two copies of a weight laid out once for
  faster GEMMs than ``F.linear``, which hands MKL the weight transposed ("NT") on
  every call:

  - up to :data:`SMALL_ROWS` input rows (decode steps): the weight transposed and
    contiguous, ``[in, out]``, for a plain ``torch.mm`` / ``addmm`` ("NN"), faster than
    ``F.linear`` for decode-sized inputs (at prefill sizes the two run alike);
  - more rows (prefill): a oneDNN reorder (``torch.ops.mkldnn._reorder_linear_weight``,
    what inductor's CPU backend uses), faster than ``F.linear`` where MKL does not use
    its fastest kernels (AMD CPUs), on par with it elsewhere. Where the build has no
    oneDNN, the transposed copy serves these rows too.

  Which copy serves decode-sized inputs is chosen once per process by
  :func:`decode_kernel`: the two copies trade places by CPU (oneDNN wins on some, the
  transposed copy on others). A probe of a few alternating GEMMs decides;
  ``HYBRIDKV_DECODE_GEMM=transposed|onednn`` forces it.

  Results differ from ``F.linear`` by float rounding only (another summation order;
  ~1e-6 relative). The copies cost two more weights' memory (the engine runs small
  models on CPU), and they are used only while the weight is unchanged: a weight
  that was modified in place, moved or cast falls back to ``F.linear`` (checked per
  call: identity, pointer, version).
"""

from __future__ import annotations

import functools
import os
import time

import torch
from torch import nn

__all__ = ["FusedQKV", "Linear", "PackedWeight", "decode_kernel", "fuse_linears", "linear", "prepack_available"]

#: ``HYBRIDKV_DECODE_GEMM`` values :func:`decode_kernel` accepts
DECODE_KERNELS = ("transposed", "onednn")

_BATCH_HINT = 32  # rows oneDNN tunes the packing for; any row count works

#: inputs of at most this many rows run on the transposed copy, larger ones on the oneDNN copy
SMALL_ROWS = 64


def prepack_available() -> bool:
    """Whether this torch build can prepack linear weights for oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def decode_kernel() -> str:
    """``"onednn"`` or ``"transposed"``: the copy decode-sized inputs (<= SMALL_ROWS rows) run on.

    ``HYBRIDKV_DECODE_GEMM`` forces one (an unknown value is ignored). Otherwise, where
    oneDNN prepacking works, 7 alternating timings of each on a seeded 16 x 1024 @ 1024 x
    4096 GEMM pick oneDNN when its median is under 0.9 times the transposed copy's
    (a tie keeps the transposed copy, the default). Either gives
    ``F.linear``'s values up to float rounding; the choice only moves speed.
    """
    forced = os.environ.get("HYBRIDKV_DECODE_GEMM", "").strip().lower()
    if forced in DECODE_KERNELS:
        return forced if forced == "transposed" or prepack_available() else "transposed"
    if not prepack_available():
        return "transposed"
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(4096, 1024, generator=gen)  # [out, in]
        x = torch.randn(16, 1024, generator=gen)  # [rows, in]
        packed = PackedWeight(weight)
        runs: dict[str, list[float]] = {"transposed": [], "onednn": []}
        for _ in range(7):
            t = time.perf_counter()
            torch.mm(x, packed.transposed)
            runs["transposed"].append(time.perf_counter() - t)
            t = time.perf_counter()
            torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")
            runs["onednn"].append(time.perf_counter() - t)
    except (RuntimeError, TypeError, AttributeError):
        return "transposed"
    median = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    return "onednn" if median["onednn"] < 0.9 * median["transposed"] else "transposed"


class PackedWeight:
    """Copies of a CPU fp32 weight [out, in] laid out for fast GEMMs, valid while the weight is unchanged.

    ``transposed``: ``[in, out]`` contiguous; ``packed``: the oneDNN reorder, or None
    where this build has none. "Unchanged": the same tensor object (a moved / cast /
    replaced weight is another one), the same storage (``.data`` not swapped) and no
    in-place write since (``_version``, which views share with their base).
    """

    __slots__ = ("transposed", "packed", "_weight", "_ptr", "_version")
    quantized = False  # a quantized weight (:mod:`~hybridkv.engine.layers.quantized_linear`) says True

    def __init__(self, weight: torch.Tensor, onednn: bool = True) -> None:
        with torch.no_grad():
            w = weight.detach()
            self.transposed = w.t().contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT) if onednn else None
        self._weight, self._ptr, self._version = weight, weight.data_ptr(), weight._version

    @classmethod
    def make(cls, weight: torch.Tensor | None) -> "PackedWeight | None":
        """The copies, or None where they do not apply (not a CPU fp32 weight). The oneDNN copy
        is left out where the build lacks oneDNN or its private ops do not give ``F.linear``'s
        result on a probe."""
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        probe = torch.linspace(-1.0, 1.0, 3 * weight.shape[1]).view(3, weight.shape[1])  # [3, in]
        want = nn.functional.linear(probe, weight.detach())
        scale = float(want.abs().max()) + 1.0
        if prepack_available():
            try:
                packed = cls(weight)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed.packed, None, "none", [], "")
                if got.shape == want.shape and float((got - want).abs().max()) <= 1e-4 * scale:
                    return packed
            except (RuntimeError, TypeError, AttributeError):
                pass
        return cls(weight, onednn=False)

    def valid_for(self, weight: torch.Tensor) -> bool:
        return weight is self._weight and weight._version == self._version and weight.data_ptr() == self._ptr


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    """``x @ weight.T + bias`` [.., out], on a packed copy when it is current (see :class:`PackedWeight`),
    or on ``packed`` itself when it is a quantized weight (:mod:`~hybridkv.engine.layers.quantized_linear`)."""
    if packed is not None and packed.quantized:
        return packed.linear(x, bias)
    if packed is not None and x.dtype == torch.float32 and packed.valid_for(weight):
        if x.dim() == 2 and (packed.packed is None or (x.shape[0] <= SMALL_ROWS and decode_kernel() == "transposed")):
            wt = packed.transposed
            return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
        if packed.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that can run on a prepacked copy of its weight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = None  # PackedWeight, a quantized weight, or None
        self.fused = False  # its weight lives in a fused matrix that another module runs

    def prepack(self, enable: bool = True) -> None:
        self.packed = PackedWeight.make(self.weight) if enable and not self.fused else None

    def quant_targets(self) -> list[tuple[str, torch.Tensor]]:
        """``(attribute, weight)``: where a quantized copy of which weight goes (none once fused)."""
        return [] if self.fused else [("packed", self.weight)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is not None and packed.quantized:  # one call less on the quantized decode path
            return packed.linear(x, self.bias)
        return linear(x, self.weight, self.bias, packed)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum out, in]`` weight (and bias) for linears on the same input.

    Each linear's parameters are replaced by views of the fused tensors, so they keep
    their names and values and no second copy of the weights stays alive.
    """
    weight = torch.cat([m.weight.detach() for m in linears])  # [sum out, in]
    for m in linears:
        m.fused = True
    bias = None
    if any(m.bias is not None for m in linears):  # a linear without bias adds zeros
        bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in linears])
    start = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


class FusedQKV(nn.Module):
    """Base of an attention whose ``q_proj``, ``k_proj``, ``v_proj`` (:class:`Linear` layers on
    one input) run as one matmul after :meth:`fuse`.

    The subclass builds the three linears, then calls :meth:`init_fused_qkv`, which registers
    ``qkv_weight`` [q out + k out + v out, in] and ``qkv_bias`` (non-persistent buffers, None
    until fused) and ``qkv_packed``: their prepacked copy or quantized weight.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear

    def init_fused_qkv(self) -> None:
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.qkv_packed: PackedWeight | None = None

    def fuse(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def prepack(self, enable: bool = True) -> None:
        self.qkv_packed = PackedWeight.make(self.qkv_weight) if enable else None

    def quant_targets(self) -> list[tuple[str, torch.Tensor]]:
        return [] if self.qkv_weight is None else [("qkv_packed", self.qkv_weight)]

    def quant_parts(self) -> dict[str, tuple[str, ...]]:
        """Which linears' weights, in row order, the fused slot holds (a checkpoint's own blocks
        are joined by rows: :mod:`~hybridkv.engine.loading.gguf_native`)."""
        return {"qkv_packed": ("q_proj", "k_proj", "v_proj")}

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, q out + k out + v out]: q, then k, then v (one matmul once fused)."""
        if self.qkv_weight is None:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        packed = self.qkv_packed
        if packed is not None and packed.quantized:  # one call less on the quantized path
            return packed.linear(x, self.qkv_bias)
        return linear(x, self.qkv_weight, self.qkv_bias, packed)
