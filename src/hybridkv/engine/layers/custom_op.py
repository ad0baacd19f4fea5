"""Layers with a torch forward and a C-kernel forward, the choice made once (vLLM's ``CustomOp``).

A :class:`CustomOp` defines ``forward_native`` (torch ops: every device and dtype, the exact
path) and ``forward_cpu_kernels`` (the fused C kernels of :mod:`hybridkv.engine.cpu_ops` on fp32
rows on a CPU; where a call's tensors do not meet a kernel's preconditions it runs
``forward_native``). :meth:`CustomOp.use_cpu_kernels` picks one by binding it as the instance's
``forward``, so a call pays no dispatch. The model's loader makes the choice for all its ops at
once (:meth:`~hybridkv.engine.models.base.CausalLM.use_cpu_kernels`: the quantized CPU path);
layers never test a platform flag themselves. The ops: RMSNorm (:mod:`.norms`), rotate-half RoPE
(:class:`~hybridkv.engine.layers.rope.RotateHalf`), the gated activation
(:class:`~hybridkv.engine.layers.activation.GatedActivation`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["CustomOp"]


class CustomOp(nn.Module):
    """An op with two implementations; ``forward`` is the one :meth:`use_cpu_kernels` chose (torch's first)."""

    def __init__(self) -> None:
        super().__init__()
        self.use_cpu_kernels(False)

    def forward_native(self, *args: Any) -> Any:
        raise NotImplementedError

    def forward_cpu_kernels(self, *args: Any) -> Any:
        raise NotImplementedError

    def use_cpu_kernels(self, enable: bool) -> None:
        """Run ``forward_cpu_kernels`` from now on when ``enable`` (the caller has checked that the
        kernels build here), else ``forward_native``."""
        self.forward = self.forward_cpu_kernels if enable else self.forward_native

    @property
    def cpu_kernels(self) -> bool:
        """Whether the C kernels are chosen."""
        return self.forward == self.forward_cpu_kernels
