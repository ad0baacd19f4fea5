"""Process-wide CPU settings the engine makes once: malloc tuning (opt-out), thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.support.tiers import scaled

from hybridkv.engine.cpu_process import fit_threads_to_affinity, keep_freed_memory


def test_keep_freed_memory_is_once_and_can_be_turned_off():
    first = keep_freed_memory()
    assert isinstance(first, bool) and keep_freed_memory() is first
    if sys.platform.startswith("linux"):
        code = "from hybridkv.engine.cpu_process import keep_freed_memory as k; print(k())"
        cases = (({"HYBRIDKV_KEEP_FREED_MEMORY": "0"}, "False"), ({}, str(first)))
        for env, want in scaled(cases, cases[:1]):  # a child each: the fast tier runs the first only
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env={**os.environ, "HYBRIDKV_KEEP_FREED_MEMORY": "1", **env}).stdout.strip()
            assert out == want
    x = torch.randn(4 << 20)  # still allocates and frees as before
    del x


def test_threads_never_raised():
    before = torch.get_num_threads()
    assert fit_threads_to_affinity() <= before
    torch.set_num_threads(before)
