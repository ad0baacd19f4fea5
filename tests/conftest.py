"""Suite-wide settings, applied before any test module imports a library."""

from __future__ import annotations

import os

import pytest

# Triton kernels run in triton's interpreter on CPU tensors unless a GPU run asks otherwise
# (HYBRIDKV_TEST_GPU=1); the variable must be set before triton is first imported.
if os.environ.get("HYBRIDKV_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _deselects_slow(config) -> bool:
    """Whether this run's ``-m`` expression keeps an unmarked test but drops a ``slow`` one
    (the fast tier, ``-m "not slow and not live"``)."""
    expr = (config.getoption("markexpr", "") or "").strip()
    if not expr:
        return False
    try:
        from _pytest.mark.expression import Expression

        compiled = Expression.compile(expr)
        return compiled.evaluate(lambda name, **kw: False) and not compiled.evaluate(lambda name, **kw: name == "slow")
    except Exception:  # a pytest without that module: read the expression
        return "not slow" in expr


def pytest_configure(config):
    """The fast tier runs randomised tests on fewer examples (``tests/support/tiers.py``): a
    Hypothesis profile for the tests that keep Hypothesis' default count, and ``tiers.FAST`` for
    the ones that write their own (``examples(n)``). The full suite runs every figure as written."""
    if not _deselects_slow(config):
        return
    from tests.support import tiers

    tiers.FAST = True
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("hybridkv-fast", max_examples=10)
    settings.load_profile("hybridkv-fast")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One torch thread for the whole session: the test models are tiny, and a second thread only
    adds synchronisation (on a busy 2-core machine a 16x16 matmul took 266 µs with two threads,
    12.6 µs with one). Without torch installed, nothing to set."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Gemma 3 (sliding window 12 + full layers) with a 128-id character tokenizer, saved
    once per session (the server, router and CLI tests serve it)."""
    pytest.importorskip("transformers")
    from tests.support.tiny_server import make_tiny_dir

    return make_tiny_dir(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    """The offline text front on the tiny model (``tiny_dir``), with the servers' engine settings
    (the server tests' and the router's in-process tests over the real app)."""
    from hybridkv.engine.llm import LLM
    from tests.support.tiny_server import engine_config

    return LLM(str(tiny_dir), engine_config())
