"""The one place that knows the CPU (engine/cpu_ops/isa.py): the ISA level from feature flags,
the cap, the bf16 rule, and the build flags each level gets; flag sets are injected, so every
rule is checked on any machine."""

from __future__ import annotations

import itertools
import random

import pytest

from hybridkv.engine.cpu_ops import build, isa
from hybridkv.engine.cpu_ops.isa import LEVELS, CpuIsa, isa_from_flags, quantized_compute_dtype
from hybridkv.errors import InvalidConfigError

ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2".split()
SKYLAKE_X = ZEN3 + "avx512f avx512dq avx512cd avx512bw avx512vl".split()
ZEN4 = SKYLAKE_X + "avx512_vnni avx512_bf16 avx512vbmi".split()
SAPPHIRE = SKYLAKE_X + "amx_tile amx_int8 amx_bf16".split()


@pytest.mark.parametrize(("flags", "level", "bf16", "compute"), [
    (ZEN3, "avx2", False, "float32"),
    (SKYLAKE_X, "avx512", False, "float32"),
    (ZEN4, "avx512_bf16", True, "bfloat16"),
    (SAPPHIRE, "avx512", True, "float32"),  # AMX bf16 but no avx512_bf16: the kernels' dots are AVX-512's
    ("sse2 sse4_2 avx".split(), "plain", False, "float32"),
    ([], "plain", False, "float32"),
])
def test_known_cpus(flags, level, bf16, compute):
    got = isa_from_flags(flags)
    assert (got.level, got.native_bf16, quantized_compute_dtype(got)) == (level, bf16, compute)


def test_other_architectures_are_plain():
    assert isa_from_flags(ZEN4, machine="aarch64") == CpuIsa("plain", False)


@pytest.mark.parametrize(("flags", "cap", "level"), [
    (ZEN4, "avx2", "avx2"), (ZEN4, "avx512", "avx512"), (ZEN4, "plain", "plain"), (ZEN3, "avx512", "avx2"),
    (ZEN3, "AVX2 ", "avx2"), (ZEN3, "plain", "plain"),
])
def test_the_cap_lowers_never_raises(flags, cap, level):
    got = isa_from_flags(flags, cap=cap)
    assert got.level == level
    assert quantized_compute_dtype(got) == ("bfloat16" if level == "avx512_bf16" else "float32")


@pytest.mark.parametrize("cap", ["avx1", "", "avx512bf16", "sse"])
def test_an_unknown_cap_is_refused(cap):
    with pytest.raises(InvalidConfigError, match="HYBRIDKV_CPU_ISA must be one of"):
        isa_from_flags(ZEN3, cap=cap)


def test_random_flag_sets():
    """The level is the highest whose flags are all present; bf16 is used only at that level."""
    universe = sorted(set(ZEN4 + SAPPHIRE))
    rng = random.Random(0)
    for _ in range(500):
        flags = {f for f in universe if rng.random() < 0.8}
        cap = rng.choice([None, *LEVELS])
        got = isa_from_flags(flags, cap=cap)
        natural = isa_from_flags(flags).level
        assert natural == next(lv for lv in LEVELS if isa._NEEDS[lv] <= flags)
        assert LEVELS.index(got.level) >= LEVELS.index(natural)  # never above what the CPU has
        if cap is not None:
            assert got.level == LEVELS[max(LEVELS.index(natural), LEVELS.index(cap))]
        assert got.uses_bf16 == (got.level == "avx512_bf16")
        assert got.native_bf16 == bool({"avx512_bf16", "amx_bf16"} & flags)


@pytest.mark.parametrize(("level", "march", "generic"), [
    ("avx512_bf16", "native", False), ("avx512", "native", False), ("avx2", "x86-64-v3", False),
    ("plain", "native", True),
])
def test_each_level_builds_for_its_target(monkeypatch, level, march, generic):
    monkeypatch.setattr(build, "cpu_isa", lambda: CpuIsa(level, level == "avx512_bf16"))
    monkeypatch.delenv("HYBRIDKV_CPU_OPS", raising=False)
    flags = build._flags()
    assert [f for f in flags if f.startswith("-march=")] == [f"-march={march}"]
    assert ("-DHYBRIDKV_GENERIC" in flags) == generic
    assert ("-mtune=native" in flags) == (march != "native")
    monkeypatch.setenv("HYBRIDKV_CPU_OPS", "generic")
    assert "-DHYBRIDKV_GENERIC" in build._flags()


def test_levels_are_distinct_builds(monkeypatch):
    """Each level's flags differ, so each is its own cached module (the flags are in the key)."""
    seen = []
    for level in LEVELS:
        monkeypatch.setattr(build, "cpu_isa", lambda level=level: CpuIsa(level, False))
        seen.append(build._flags())
    assert all(a != b for a, b in itertools.combinations(seen[1:], 2))  # avx512 / avx2 / plain


def test_this_machine_reads_its_flags():
    here = isa.cpu_isa()
    assert here.level in LEVELS
    assert isa_from_flags(isa.cpu_flags(), cap=None).native_bf16 == here.native_bf16
