"""Linear layers for inference: fused projections and prepacked CPU weights.

* :func:`fuse_linears` - linears on the same input (q/k/v, gate/up) become one
  matmul; their parameters turn into views of the fused weight, so names,
  ``state_dict`` and memory stay as loaded.
* :class:`PackedWeight` - on CPU in fp32, a copy of a weight reordered once for
  oneDNN (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU backend
  uses). ``F.linear`` goes to MKL, which repacks the weight on every call and, on
  AMD CPUs, does not use its fastest kernels; the prepacked oneDNN matmul measured
  1.3-1.5x faster for this engine's shapes (2048 x 256 x 1024 prefill, 32-row
  decode). Results differ from ``F.linear`` by float rounding only (another
  summation order; ~1e-6 relative). The copy costs one more weight's memory, and it
  is used only while the weight is unchanged: a weight that was modified in place,
  moved or cast falls back to ``F.linear`` (checked per call: identity, pointer, version).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Linear", "PackedWeight", "fuse_linears", "linear", "prepack_available"]

_BATCH_HINT = 32  # rows oneDNN tunes the packing for; any row count works


def prepack_available() -> bool:
    """Whether this torch build can prepack linear weights for oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedWeight:
    """A oneDNN-prepacked copy of a CPU fp32 weight [out, in], valid while the weight is unchanged.

    "Unchanged": the same tensor object (a moved / cast / replaced weight is another
    one), the same storage (``.data`` not swapped) and no in-place write since
    (``_version``, which views share with their base).
    """

    __slots__ = ("packed", "_weight", "_ptr", "_version")

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self._weight, self._ptr, self._version = weight, weight.data_ptr(), weight._version

    @classmethod
    def make(cls, weight: torch.Tensor | None) -> "PackedWeight | None":
        """The packed copy, or None where it does not apply (not CPU fp32, no oneDNN, or the
        private oneDNN ops of this torch build do not give ``F.linear``'s result on a probe)."""
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or not prepack_available():
            return None
        try:
            packed = cls(weight)
            probe = torch.linspace(-1.0, 1.0, 3 * weight.shape[1]).view(3, weight.shape[1])  # [3, in]
            got = torch.ops.mkldnn._linear_pointwise(probe, packed.packed, None, "none", [], "")
            want = nn.functional.linear(probe, weight.detach())
        except (RuntimeError, TypeError, AttributeError):
            return None
        scale = float(want.abs().max()) + 1.0
        return packed if got.shape == want.shape and float((got - want).abs().max()) <= 1e-4 * scale else None

    def valid_for(self, weight: torch.Tensor) -> bool:
        return weight is self._weight and weight._version == self._version and weight.data_ptr() == self._ptr


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` [.., out], on the packed copy when it is current."""
    if packed is not None and x.dtype == torch.float32 and packed.valid_for(weight):
        return torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that can run on a prepacked copy of its weight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed: PackedWeight | None = None

    def prepack(self, enable: bool = True) -> None:
        self.packed = PackedWeight.make(self.weight) if enable else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum out, in]`` weight (and bias) for linears on the same input.

    Each linear's parameters are replaced by views of the fused tensors, so they keep
    their names and values and no second copy of the weights stays alive.
    """
    weight = torch.cat([m.weight.detach() for m in linears])  # [sum out, in]
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
