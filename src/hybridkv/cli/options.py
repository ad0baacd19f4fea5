"""Option value types shared by the sub-commands: one parser per kind of value.

Each is an argparse ``type=``: a bad value becomes argparse's usage error, one line
and exit 2, carrying hybridkv's message::

    hybridkv plan: error: argument --max-model-len: invalid token count '12x'; expected ...

``--max-model-len`` is :func:`tokens` in every command (vLLM's suffixes: ``128k`` =
128_000, ``128K`` = 131_072), memory sizes are :func:`memory` (explicit units:
``80GiB``, ``80GB``), and numbers are checked for range here, before any work.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from hybridkv.errors import InvalidArgumentError
from hybridkv.planner.sizes import parse_bytes, parse_tokens

__all__ = ["tokens", "memory", "int_range", "finite_float", "SEED_MAX"]

#: seeds are 0 .. 2**63 - 1 (torch's generators take no more)
SEED_MAX = 2**63 - 1


def tokens(text: str) -> int:
    """A token count with vLLM's suffixes (see :func:`hybridkv.planner.sizes.parse_tokens`)."""
    try:
        return parse_tokens(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory(text: str) -> int:
    """Bytes with an explicit unit (see :func:`hybridkv.planner.sizes.parse_bytes`)."""
    try:
        return parse_bytes(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_range(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An int in ``[low, high]``; ``why`` explains the bound in the message."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high:,}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}{why}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def finite_float(low: float, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in ``[low, high]`` (``(low, high]`` when ``low_open``); nan and inf are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or (high is not None and value > high):
            bracket = "(" if low_open else "["
            bound = f"in {bracket}{low:g}, {high:g}]" if high is not None else f"{'>' if low_open else '>='} {low:g}"
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse
