"""Suite-wide settings, applied before any test module imports a library."""

from __future__ import annotations

import os

# Triton kernels run in triton's interpreter on CPU tensors unless a GPU run asks otherwise
# (HYBRIDKV_TEST_GPU=1); the variable must be set before triton is first imported.
if os.environ.get("HYBRIDKV_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
