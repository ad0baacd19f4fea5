"""The fast tier (``-m "not slow and not live"``, the developer loop) vs the full suite (CI).

``tests/conftest.py`` sets ``FAST`` in ``pytest_configure`` (before any test module is
imported) when the run's ``-m`` expression deselects ``slow``. Randomised tests then size
themselves with :func:`examples` / :func:`scaled`: the full suite runs exactly the figures
written in the test (the same examples, seeds and steps as always), the fast tier a smaller
sample of the same test. Nothing else changes between the tiers.
"""

from __future__ import annotations

FAST = False


def fast_tier() -> bool:
    """Whether this run is the fast tier (it deselects ``slow``)."""
    return FAST


def scaled(full, fast):
    """``full`` in the full suite, ``fast`` when the run deselects ``slow``."""
    return fast if FAST else full


def examples(full: int, fast: int | None = None) -> int:
    """A Hypothesis ``max_examples``: ``full`` in the full suite; in the fast tier ``fast``
    (default: a tenth of ``full``, at least 5)."""
    if not FAST:
        return full
    return min(full, fast if fast is not None else max(5, full // 10))


def slow_except(values, *keep, multi: bool = False) -> list:
    """``values`` for ``pytest.mark.parametrize`` with every case but the ones at the indices
    ``keep`` marked ``slow`` (the fast tier runs the kept ones, the full suite all, under the
    same ids). ``multi``: each value is a tuple of several argnames' values."""
    import pytest
    from _pytest.mark import ParameterSet

    out = []
    for i, v in enumerate(values):
        if i in keep:
            out.append(v)
        elif isinstance(v, ParameterSet):
            out.append(pytest.param(*v.values, marks=[*v.marks, pytest.mark.slow], id=v.id))
        else:
            out.append(pytest.param(*(v if multi else (v,)), marks=pytest.mark.slow))
    return out
