"""Human-readable sizes: memory budgets in bytes and context lengths in tokens.

Bytes (:func:`parse_bytes`) use explicit units only, so nothing is ambiguous::

    "80GiB" -> 80 * 2**30 = 85_899_345_920     (binary: KiB MiB GiB TiB, or Ki Mi Gi Ti)
    "80GB"  -> 80 * 10**9 = 80_000_000_000     (decimal: kB/KB MB GB TB)
    "1.5TiB" -> 1.5 * 2**40 = 1_649_267_441_664
    "4096" or "4096B" -> 4096 bytes

A bare letter ("80G") is refused: it means 10**9 to some tools and 2**30 to others.
Unit letters are case-insensitive ("80gib" is 80 GiB).

Tokens (:func:`parse_tokens`) follow vLLM's ``--max-model-len`` convention, where
the case of the suffix picks the base::

    "1k" -> 1_000       "1K" -> 1_024
    "1m" -> 1_000_000   "1M" -> 1_048_576
    "1g" -> 10**9       "1G" -> 2**30        ("t"/"T": 10**12 / 2**40)
    "25.6k" -> 25_600   (decimals only with decimal suffixes, and the result must be whole)

A value that does not parse, is not positive, or is above a sane ceiling
(:data:`MAX_BYTES` = 1 PiB of memory, :data:`MAX_TOKENS` = 2**40 tokens; no machine
or model comes near either, and a typo such as ``999999999999999TiB`` should not be
planned for) raises :class:`~hybridkv.errors.InvalidArgumentError` with a one-line
message naming the value. Digits are ASCII only.
"""

from __future__ import annotations

import re
from fractions import Fraction

from hybridkv.errors import InvalidArgumentError

__all__ = ["MAX_BYTES", "MAX_TOKENS", "parse_bytes", "parse_tokens", "format_bytes", "format_tokens"]

#: the largest memory size accepted: 1 PiB (a whole GPU rack holds ~1% of it)
MAX_BYTES = 2**50
#: the largest token count accepted: 2**40 (1T, about 10**12; no model's context comes near)
MAX_TOKENS = 2**40

_BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}

_TOKEN_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TOKEN_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_BYTES_RE = re.compile(rf"{_NUMBER}\s*([A-Za-z]*)")
_TOKENS_RE = re.compile(rf"{_NUMBER}\s*([kKmMgGtT]?)")


def parse_bytes(text: str | int) -> int:
    """Bytes in ``text`` ("80GiB", "80GB", "512MiB", "1.5TiB", "4096"); must be positive.

    Fractions of a byte are rounded down ("1.0000000001KiB" is 1024 bytes).
    """
    if isinstance(text, bool):
        raise InvalidArgumentError(f"invalid memory size {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _BYTES_RE.fullmatch(str(text).strip())
        if match is None:
            raise InvalidArgumentError(
                f"invalid memory size {text!r}; expected a number and a unit such as 80GiB, 80GB, 512MiB"
            )
        number, unit = match.groups()
        key = unit.lower()
        if key not in _BYTE_UNITS:
            if key in ("k", "m", "g", "t"):
                raise InvalidArgumentError(
                    f"ambiguous memory unit {unit!r} in {text!r}; "
                    f"write {unit.upper()}iB (binary) or {unit.upper()}B (decimal)"
                )
            raise InvalidArgumentError(
                f"unknown memory unit {unit!r} in {text!r}; "
                "expected B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
            )
        value = int(Fraction(number) * _BYTE_UNITS[key])
    if value <= 0:
        raise InvalidArgumentError(f"memory size must be positive, got {text!r}")
    if value > MAX_BYTES:
        raise InvalidArgumentError(
            f"memory size {text!r} ({value:,} bytes) is above the limit of {format_bytes(MAX_BYTES)}; check the unit"
        )
    return value


def parse_tokens(text: str | int) -> int:
    """Token count in ``text`` with vLLM's suffixes (see the module docstring); must be positive."""
    if isinstance(text, bool):
        raise InvalidArgumentError(f"invalid token count {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _TOKENS_RE.fullmatch(str(text).strip())
        if match is None:
            raise InvalidArgumentError(
                f"invalid token count {text!r}; expected a whole number with an optional suffix "
                "k/m/g/t (x1000, decimals allowed: 25.6k) or K/M/G/T (x1024), such as 128k or 1M"
            )
        number, suffix = match.groups()
        if suffix in _TOKEN_BINARY:
            if not number.isdigit():
                raise InvalidArgumentError(
                    f"decimals are not allowed with the binary suffix {suffix!r} in {text!r}; "
                    f"did you mean {number}{suffix.lower()}?"
                )
            value = int(number) * _TOKEN_BINARY[suffix]
        else:
            exact = Fraction(number) * _TOKEN_DECIMAL.get(suffix, 1)
            if exact.denominator != 1:
                raise InvalidArgumentError(f"token count {text!r} is not a whole number of tokens")
            value = int(exact)
    if value <= 0:
        raise InvalidArgumentError(f"token count must be positive, got {text!r}")
    if value > MAX_TOKENS:
        raise InvalidArgumentError(f"token count {text!r} ({value:,}) is above the limit of {MAX_TOKENS:,} (1T)")
    return value


def format_bytes(num_bytes: int) -> str:
    """Binary-unit rendering: 65536 -> "64 KiB", 85899345920 -> "80 GiB", 1536 -> "1.50 KiB"."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            if num_bytes % size == 0:
                return f"{num_bytes // size} {unit}"
            return f"{num_bytes / size:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_tokens(num_tokens: int) -> str:
    """Tokens with thousands separators: 1048576 -> "1,048,576"."""
    return f"{num_tokens:,}"
