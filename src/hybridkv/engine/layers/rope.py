"""Rotary position embeddings as HF transformers 5.24 computes them.

Inverse frequencies for ``rope_type`` default / linear / llama3 / yarn (the types
the supported families ship with), read from a config's ``rope_parameters`` (new
format) or ``rope_theta`` + ``rope_scaling`` (old format). Two ways to rotate:

* ``apply_rotate_half`` - Llama, Mistral, Qwen2, Gemma 3, GPT-OSS: dims ``i`` and
  ``i + D/2`` form a pair;
* ``apply_interleaved`` - Llama 4: dims ``2i`` and ``2i + 1`` form a pair, one complex
  number multiplied by ``cis = polar(1, angle) * attention_scaling`` (HF's own ops, so
  bit-identical to HF; one complex multiply instead of a dozen real ops).

``RotaryEmbedding.tables(positions)`` gives what the apply function of its kind takes:
``(cos, sin)`` for rotate-half, ``cis`` for an ``interleaved`` rotary.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine.layers.custom_op import CustomOp
from hybridkv.errors import InvalidConfigError

__all__ = ["RotateHalf", "rope_parameters", "inv_freq_and_scale", "RotaryEmbedding", "apply_rotate_half", "apply_interleaved"]


def rope_parameters(config: Mapping[str, Any], default_theta: float, sub_key: str | None = None) -> dict:
    """The rope parameter dict of ``config`` (``sub_key`` selects a per-layer-type entry)."""
    params = config.get("rope_parameters")
    if params is not None and sub_key is not None:
        params = params.get(sub_key)
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_theta", config.get("rope_theta", default_theta))
    params = dict(params)
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", default_theta)
    return params


def inv_freq_and_scale(params: Mapping[str, Any], head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2], attention_scaling)`` exactly as HF's ROPE_INIT_FUNCTIONS."""
    rope_type = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidConfigError("partial_rotary_factor != 1 is not supported")
    dim = head_dim
    if rope_type == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    if rope_type == "linear":
        return (1.0 / (base**exponents)) / float(params["factor"]), 1.0
    if rope_type == "llama3":
        inv_freq = 1.0 / (base**exponents)
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    if rope_type == "yarn":
        return _yarn(params, base, dim, max_position_embeddings)
    raise InvalidConfigError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn")


def _yarn(params: Mapping[str, Any], base: float, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos / sin (or complex ``cis``) tables for given positions; ``inv_freq`` [D/2]."""

    def __init__(
        self, params: Mapping[str, Any], head_dim: int, max_position_embeddings: int, interleaved: bool = False
    ) -> None:
        self.inv_freq, self.attention_scaling = inv_freq_and_scale(params, head_dim, max_position_embeddings)
        self.interleaved = interleaved
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # a copy per device: no copy per step

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> angles [T, D/2] (fp32)."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        return positions.float().unsqueeze(-1) * inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D] scaled by ``attention_scaling``, laid out for
        :func:`apply_rotate_half`: ``cos = [c, c]``, ``sin = [-s, s]`` (c, s [T, D/2])."""
        f = self.freqs(positions)
        c, s = (f.cos() * self.attention_scaling).to(dtype), (f.sin() * self.attention_scaling).to(dtype)
        return torch.cat((c, c), dim=-1).unsqueeze(1), torch.cat((-s, s), dim=-1).unsqueeze(1)

    def cis(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> complex64 [T, D/2]: ``polar(1, angle) * attention_scaling`` (HF Llama 4)."""
        f = self.freqs(positions)
        return torch.polar(torch.ones_like(f), f) * self.attention_scaling

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """What this rotary's apply function takes: ``cis``, or ``(cos, sin)`` in ``dtype``."""
        return self.cis(positions) if self.interleaved else self.cos_sin(positions, dtype)


def apply_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x [T, H, D], cos / sin [T, 1, D] from :meth:`RotaryEmbedding.cos_sin`: pairs (i, i + D/2)
    rotated by angle i, HF's ``x * cos + rotate_half(x) * sin`` in four ops.

    ``roll(x, D/2)`` is ``[x2, x1]`` and ``sin`` carries the sign, so the first half is
    ``x1 * c + x2 * (-s)``, which is ``x1 * c - x2 * s`` bit for bit, as HF computes it
    (``rotate_half(x) = [-x2, x1]``).
    """
    if (fused and x.dtype == torch.float32 and cos.dtype == torch.float32 and x.dim() == 3 and x.device.type == "cpu"
            and x.stride(-1) == 1 and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2]) and cos.is_contiguous()
            and sin.is_contiguous()):
        return cpu_ops.rope_rotate_half(x, cos, sin)  # ``fused``: the C kernel, the same bits in one pass
    out = x * cos
    return out.add_(x.roll(x.shape[-1] // 2, dims=-1) * sin)


def apply_interleaved(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cis [T, D/2] complex: pairs (2i, 2i + 1) rotated by angle i (complex product)."""
    xf = x if x.dtype == torch.float32 else x.float()
    xc = torch.view_as_complex(xf.reshape(*x.shape[:-1], -1, 2))  # [T, H, D/2] complex
    out = torch.view_as_real(xc * cis.unsqueeze(1)).flatten(-2)  # [T, H, D] fp32
    return out if out.dtype == x.dtype else out.to(x.dtype)


class RotateHalf(CustomOp):
    """:func:`apply_rotate_half` as a layer: torch's ops, or with the C kernels chosen the fused pass
    (the same bits) for fp32 rows on a CPU."""

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotate_half(x, cos, sin)

    def forward_cpu_kernels(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotate_half(x, cos, sin, fused=True)
