"""What this CPU can run, and the rules that follow: the one place that knows the CPU.

The **ISA level** is read once from the CPU's feature flags (``/proc/cpuinfo``), highest first:

=============== ============================================== =====================================
level           needs (flags)                                  the C kernels are built for
=============== ============================================== =====================================
``avx512_bf16`` avx512f, avx512bw, avx512vl, avx512_bf16       ``-march=native``: AVX-512 + bf16 dots
``avx512``      avx512f, avx512bw, avx512vl                    ``-march=native``: AVX-512
``avx2``        avx2, fma, f16c                                ``-march=x86-64-v3``: AVX2 + FMA
``plain``       anything else (another architecture included)  ``-march=native``, no intrinsics
=============== ============================================== =====================================

``HYBRIDKV_CPU_ISA`` (``avx512``, ``avx2``, ``plain``) lowers the level, never raises it: the
AVX2 kernels measured on an AVX-512 machine, or the bf16 rule forced off.

**The bf16 rule.** A CPU without native bf16 arithmetic (no ``avx512_bf16``, no ``amx_bf16``)
multiplies bf16 through conversions, a bf16 GEMM there can be hundreds of times slower than
fp32. On such a CPU the quantized path computes in fp32: its rows stay fp32 (with AVX-512
the C kernels' fp32 dot products; the ``avx2`` build rounds them to 16-bit integers per block
of 256 columns for integer dot products, ``cpu_ops.rounded_rows``), a prefill chunk multiplies
the dequantized weight in fp32, and no activation is rounded to bf16
(:func:`quantized_compute_dtype`). Worked example: on an AMD
EPYC Zen 3 (``avx2``, no bf16) ``--quantization int8`` computes in float32; on a Zen 4
(``avx512_bf16``) in bfloat16.

Torch-free; the flags are injectable (:func:`isa_from_flags`) so the rules are unit-tested on
any machine.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from typing import Iterable

__all__ = ["LEVELS", "CpuIsa", "cpu_flags", "cpu_flags_line", "cpu_isa", "isa_from_flags", "quantized_compute_dtype"]

#: ISA levels, highest first
LEVELS = ("avx512_bf16", "avx512", "avx2", "plain")
_NEEDS = {
    "avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    "avx512": {"avx512f", "avx512bw", "avx512vl"},
    "avx2": {"avx2", "fma", "f16c"},
    "plain": set(),
}
#: the compiler's target per level (``native``: the machine's own)
MARCH = {"avx512_bf16": "native", "avx512": "native", "avx2": "x86-64-v3", "plain": "native"}


@dataclass(frozen=True, slots=True)
class CpuIsa:
    """``level``: one of :data:`LEVELS`; ``native_bf16``: bf16 dot products in hardware (AVX-512
    bf16 or AMX), whatever the level in force."""

    level: str
    native_bf16: bool

    @property
    def uses_bf16(self) -> bool:
        """Whether bf16 arithmetic may be used: native bf16, and a level that has it."""
        return self.native_bf16 and self.level == "avx512_bf16"

    @property
    def march(self) -> str:
        """What the C kernels are compiled for (``-march=``)."""
        return MARCH[self.level]

    @property
    def intrinsics(self) -> bool:
        """Whether the kernels' hand-written vector code is built (else plain loops)."""
        return self.level != "plain"


def isa_from_flags(flags: Iterable[str], machine: str = "x86_64", cap: str | None = None) -> CpuIsa:
    """The ISA of a CPU with feature ``flags`` (``/proc/cpuinfo`` names), lowered to ``cap``.

    >>> isa_from_flags("fma avx2 f16c sse4_2".split())
    CpuIsa(level='avx2', native_bf16=False)
    >>> isa_from_flags("avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16".split(), cap="avx2")
    CpuIsa(level='avx2', native_bf16=True)
    """
    have = set(flags)
    x86 = machine.lower() in ("x86_64", "amd64", "i386", "i686")
    level = next((lv for lv in LEVELS if x86 and _NEEDS[lv] <= have), "plain") if x86 else "plain"
    if cap is not None:
        cap = cap.strip().lower()
        if cap not in LEVELS:
            from hybridkv.errors import InvalidConfigError

            raise InvalidConfigError(f"HYBRIDKV_CPU_ISA must be one of {', '.join(LEVELS[1:])}; got {cap!r}")
        if LEVELS.index(cap) > LEVELS.index(level):
            level = cap
    native_bf16 = x86 and ("avx512_bf16" in have or "amx_bf16" in have)
    return CpuIsa(level, native_bf16)


def cpu_flags_line() -> str | None:
    """``/proc/cpuinfo``'s first ``flags`` (x86) or ``Features`` (Arm) line as it is ("" where it
    has none); None where there is no ``/proc/cpuinfo``."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (:func:`cpu_flags_line`'s names; empty where there are none)."""
    return frozenset((cpu_flags_line() or "").partition(":")[2].split())


@functools.cache
def cpu_isa() -> CpuIsa:
    """This CPU's ISA (read once per process), lowered by ``HYBRIDKV_CPU_ISA`` when set."""
    return isa_from_flags(cpu_flags(), platform.machine(), os.environ.get("HYBRIDKV_CPU_ISA") or None)


def quantized_compute_dtype(isa: CpuIsa | None = None) -> str:
    """The compute dtype of weight-only quantized matmuls on a CPU of ``isa`` (this one by
    default): ``"bfloat16"`` where bf16 is native, else ``"float32"`` (the bf16 rule)."""
    return "bfloat16" if (isa or cpu_isa()).uses_bf16 else "float32"
