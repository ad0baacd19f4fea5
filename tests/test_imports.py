"""The core, planner and scheduler are torch-free; the public API is tidy."""

import subprocess
import sys

import pytest
from tests.support.tiers import slow_except


@pytest.mark.parametrize(
    "module",
    slow_except(["hybridkv", "hybridkv.core.kv_cache_manager", "hybridkv.planner", "hybridkv.scheduler", "hybridkv.cli",
                 "hybridkv.engine_config", "hybridkv.cli.engine_args"], 0, 4),  # the fast tier: hybridkv, hybridkv.cli
)
def test_importing_leaves_torch_out(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_public_api_names_exist():
    import hybridkv

    for name in hybridkv.__all__:
        assert hasattr(hybridkv, name), name


@pytest.mark.parametrize(
    ("module", "absent"),
    slow_except([("hybridkv.router.app", "hybridkv.server"), ("hybridkv.router.events", "hybridkv.server"),
                 ("hybridkv.server.app", "hybridkv.router"), ("hybridkv.protocol.openai", "hybridkv.server"),
                 ("hybridkv.protocol.kv_events", "hybridkv.server"), ("hybridkv.protocol.limits", "hybridkv.server")],
                0, multi=True),  # the fast tier: the router app (the server app's import takes seconds)
)
def test_server_and_router_are_siblings(module, absent):
    """The wire formats live in hybridkv.protocol: the router never imports the server, nor the
    server the router."""
    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in sys.modules if m == {absent!r} or m.startswith({absent!r} + '.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
