"""Fixtures of the server tests: live ``hybridkv serve`` processes on 127.0.0.1 (``serve``); the
offline engine on the tiny model (``tiny_llm``) is the root conftest's.

The processes are :class:`tests.support.processes.HybridkvProcess` (bounded in time: a
server that does not start or stop in time is killed and the test fails).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")


from tests.support.processes import HybridkvProcess  # noqa: E402
from tests.support.tiny_server import ENGINE_ARGS  # noqa: E402


@pytest.fixture
def serve(tiny_dir):
    """Start ``hybridkv serve TINY --port 0 ...extra``; every server is stopped at teardown."""
    started: list[HybridkvProcess] = []

    def start(*extra: str, env: dict | None = None) -> HybridkvProcess:
        s = HybridkvProcess([str(tiny_dir), "--port", "0", "--served-model-name", "tiny", *ENGINE_ARGS, *extra], env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()
