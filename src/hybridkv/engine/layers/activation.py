"""Activations by HF's names, and the gated MLP's ``act(gate) * up`` as a :class:`~.custom_op.CustomOp`."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.engine import cpu_ops
from hybridkv.engine.layers.custom_op import CustomOp
from hybridkv.errors import InvalidConfigError

__all__ = ["GatedActivation", "activation", "activation_kernel"]


def activation(name: str):
    """The activation function HF's ``ACT2FN[name]`` names."""
    if name in ("silu", "swish"):
        return nn.functional.silu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh"):
        return lambda x: nn.functional.gelu(x, approximate="tanh")
    if name == "gelu":
        return nn.functional.gelu
    if name == "relu":
        return nn.functional.relu
    raise InvalidConfigError(f"unsupported activation {name!r}")


def activation_kernel(name: str) -> str | None:
    """The fused C kernel's name for :func:`activation` ``name`` (:data:`hybridkv.engine.cpu_ops.ACTIVATIONS`),
    None where it has none."""
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh"):
        return "gelu_tanh"
    return None


class GatedActivation(CustomOp):
    """gate_up [T, 2I] (gate columns, then up) -> ``act(gate) * up`` [T, I]; in one C pass for fp32
    rows with the C kernels chosen and an activation they have (silu, gelu-tanh)."""

    def __init__(self, name: str, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.act = activation(name)
        #: the C kernel's name for this activation (:data:`hybridkv.engine.cpu_ops.ACTIVATIONS`), None if none
        self.kernel = activation_kernel(name)

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return self.act(gate).mul_(up)  # act() returns a fresh tensor: no extra buffer

    def forward_cpu_kernels(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and gate_up.dtype == torch.float32 and gate_up.stride(-1) == 1:
            return cpu_ops.gated_act(gate_up, self.kernel)
        return self.forward_native(gate_up)
