"""The core, planner and scheduler are torch-free; the public API is tidy."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["hybridkv", "hybridkv.core.kv_cache_manager", "hybridkv.planner", "hybridkv.scheduler", "hybridkv.cli",
     "hybridkv.engine_config", "hybridkv.cli.engine_args"],
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
    [("hybridkv.router.app", "hybridkv.server"), ("hybridkv.router.events", "hybridkv.server"),
     ("hybridkv.server.app", "hybridkv.router"), ("hybridkv.protocol.openai", "hybridkv.server"),
     ("hybridkv.protocol.kv_events", "hybridkv.server"), ("hybridkv.protocol.limits", "hybridkv.server")],
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
