"""What the benchmarks beside vLLM share: vLLM imported, or how to install it printed
(exit 0: vLLM is never a dependency)."""

from __future__ import annotations

import importlib
import os
import sys


SETUP = """\
{script} needs vLLM 0.33.0 (and torch 2.13, CPU is fine) in a benchmark-only environment:

    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0
    .venv-vllm/bin/pip install --no-deps -r ../shared/bench/vllm-anchor-requirements.txt

then, from the repository root:

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/{script}{args}

(vLLM is never a dependency of hybridkv, and this benchmark is not part of CI.)"""



def import_vllm(script: str, module: str, args: str = "") -> None:
    """Import ``module`` of vLLM (quietly, with a fixed hash seed), or print the set-up and exit 0."""
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        importlib.import_module("torch")
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install
        print(f"vLLM is not importable here ({type(exc).__name__}: {exc}).\n")
        print(SETUP.format(script=script, args=args))
        sys.exit(0)
