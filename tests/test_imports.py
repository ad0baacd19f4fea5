"""The core, planner and scheduler are torch-free; the public API is tidy."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["hybridkv", "hybridkv.core.kv_cache_manager", "hybridkv.planner", "hybridkv.scheduler", "hybridkv.cli"],
)
def test_importing_leaves_torch_out(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_public_api_names_exist():
    import hybridkv

    for name in hybridkv.__all__:
        assert hasattr(hybridkv, name), name
