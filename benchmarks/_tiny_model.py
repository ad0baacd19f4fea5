"""The tiny random Gemma 3 of the tests (sliding window 12 + full layers, a 128-id character
tokenizer), written to a directory: the default model of the serving benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_model_dir(path: Path) -> str:
    if str(ROOT) not in sys.path:  # the test suite's tiny-model recipes (tests/support)
        sys.path.insert(0, str(ROOT))
    from tests.support.hf_tiny import build_tiny
    from tests.support.tiny_tokenizer import write_tokenizer

    build_tiny("gemma3", path)
    write_tokenizer(path)
    return str(path)
