"""RMSNorm as HF computes it, in one fused op where the values allow.

HF (Llama, Mistral, Qwen): ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``; Gemma 3 and
Qwen3-Next (``unit_offset``): ``(x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)).to(dtype)``.
``torch.nn.functional.rms_norm`` on fp32 computes exactly ``x * rsqrt(mean(x^2) + eps) * w``
(bit for bit on the CPU: tests/test_norms.py), so with the multiplier ``w`` or ``1 + w``
made once in fp32 a norm is one op instead of eight, and a bf16 input three (up-cast,
norm, down-cast). A decode step of Gemma 3 runs six norms per layer, so the ops saved add
up in every layer.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from hybridkv.engine import cpu_ops
from hybridkv.engine.layers.custom_op import CustomOp

__all__ = ["RMSNorm", "rms_norm_heads", "stacked_scales"]


class RMSNorm(CustomOp):
    """``x / rms(x) * w`` in fp32; ``unit_offset`` (Gemma) uses ``(1 + w)``."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self._scale: torch.Tensor | None = None  # the fp32 multiplier, see scale()
        self._scale_of: tuple | None = None  # (weight storage, version, device) it was made from

    def weight_key(self) -> tuple:
        """Changes whenever the weight does (storage, in-place version, dtype, device)."""
        w = self.weight
        return (w.data_ptr(), w._version, w.dtype, w.device)

    def scale(self) -> torch.Tensor:
        """``w`` or ``1 + w`` in fp32 [dim], remade only when the weight changed (loaded, moved, cast)."""
        w = self.weight
        key = self.weight_key()
        if key != self._scale_of:
            with torch.no_grad():
                w32 = w.detach().float()
                self._scale = 1.0 + w32 if self.unit_offset else w32.clone()
            self._scale_of = key
        return self._scale

    def forward_cpu_kernels(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1:
            return cpu_ops.rms_norm(x, self.scale(), self.eps)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return nn.functional.rms_norm(x, shape, self.scale(), self.eps)
        if self.unit_offset:
            return nn.functional.rms_norm(x.float(), shape, self.scale(), self.eps).to(x.dtype)
        return self.weight * nn.functional.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


def stacked_scales(norms: Sequence[tuple[RMSNorm, int]], fp32: bool = True) -> torch.Tensor:
    """[sum n_i, D]: the multiplier of ``norms[i] = (norm_i, n_i)`` repeated for its ``n_i`` heads
    (fp32 :meth:`RMSNorm.scale`, or the raw weights where ``fp32`` is False): what
    :func:`rms_norm_heads` multiplies by, and the fused decode step's q/k norms."""
    with torch.no_grad():
        return torch.cat([(n.scale() if fp32 else n.weight.detach()).expand(c, -1) for n, c in norms]).contiguous()


def rms_norm_heads(x: torch.Tensor, norms: Sequence[tuple[RMSNorm, int]], cache: dict) -> torch.Tensor:
    """x [T, H, D] normalized per head: the first ``n_0`` heads by ``norms[0] = (norm_0, n_0)``,
    the next ``n_1`` by ``norm_1``, ... (``sum n_i = H``), as each norm alone would, bit for bit.

    One norm without weight and one multiply by the norms' multipliers stacked ``[H, D]``
    (made once, kept in ``cache``), instead of a norm per part: Gemma 3 and Qwen3 norm q and k
    heads with ``q_norm`` / ``k_norm`` before RoPE, one pass here.
    """
    first = norms[0][0]
    if any(n.eps != first.eps or n.unit_offset != first.unit_offset for n, _ in norms):
        raise ValueError("rms_norm_heads needs norms of one kind (eps, unit offset)")
    # HF multiplies before the down-cast with Gemma's ``1 + w`` (unit offset), after it with Llama's ``w``
    in_fp32 = x.dtype == torch.float32 or first.unit_offset
    key = (tuple((n.weight_key(), c) for n, c in norms), in_fp32, x.dtype)
    if cache.get("key") != key:
        cache["scale"] = stacked_scales(norms, in_fp32)  # [H, D]
        cache["key"] = key
    scale = cache["scale"]
    shape = (x.shape[-1],)
    if first.cpu_kernels and x.dtype == torch.float32 and x.dim() == 3 and x.device.type == "cpu" and x.stride(-1) == 1:
        return cpu_ops.rms_norm(x, scale, first.eps)
    if x.dtype == torch.float32:
        return nn.functional.rms_norm(x, shape, None, first.eps).mul_(scale)
    if in_fp32:
        return nn.functional.rms_norm(x.float(), shape, None, first.eps).mul_(scale).to(x.dtype)
    return nn.functional.rms_norm(x.float(), shape, None, first.eps).to(x.dtype).mul_(scale)
