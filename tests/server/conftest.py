"""Fixtures of the server tests: the offline engine on the tiny sliding-window model
(``tiny_dir``), and live ``hybridkv serve`` processes on 127.0.0.1 (``serve``).

The processes are :class:`tests.support.processes.HybridkvProcess` (bounded in time: a
server that does not start or stop in time is killed and the test fails).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")


from tests.support.processes import HybridkvProcess  # noqa: E402
from tests.support.tiny_server import ENGINE_ARGS, engine_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    """The offline text front on the tiny model (``tiny_dir``, the root conftest's), with the
    servers' engine settings."""
    from hybridkv.engine.llm import LLM

    return LLM(str(tiny_dir), engine_config())


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
