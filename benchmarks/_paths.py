"""Where the benchmark scripts import from, set once: this checkout's ``src`` (so a script
measures this tree's hybridkv, whatever is installed) and the repository root (for
``tests.support``: the process harness, port helper and tiny-model recipes the tests use).

Each script starts with ``import _paths``; its own folder, and with it the other
``benchmarks/_*.py`` modules, is already on ``sys.path`` (Python puts a script's folder first).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

for _path in (ROOT, SRC):  # SRC ends up first
    if _path.is_dir() and str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
