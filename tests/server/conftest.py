"""Fixtures of the server tests: a tiny sliding-window model with a tokenizer, the offline
engine on it, an in-process app, and a live ``hybridkv serve`` process on 127.0.0.1.

Every process and socket here is bounded in time: a server that does not print its ready
line within ``READY_TIMEOUT`` seconds, or does not exit within ``STOP_TIMEOUT`` of
SIGTERM, is killed and the test fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from _hf_tiny import build_tiny  # noqa: E402
from _tiny_tokenizer import write_tokenizer  # noqa: E402

READY_TIMEOUT = 90.0
STOP_TIMEOUT = 60.0
#: the engine settings every server test uses (tiny blocks: many block boundaries, sliding frees)
ENGINE_ARGS = ("--block-size", "4", "--max-num-seqs", "16", "--max-model-len", "256")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 (sliding window 12 + full layers) with a 128-id character tokenizer."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    build_tiny("gemma3", path)
    write_tokenizer(path)
    return path


def engine_config(**overrides):
    from hybridkv.engine.engine import EngineConfig

    kw = dict(block_size=4, max_num_seqs=16, max_model_len=256)
    kw.update(overrides)
    return EngineConfig(**kw)


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    """The offline text front on the tiny model, with the servers' engine settings."""
    import torch

    torch.set_num_threads(1)
    from hybridkv.engine.llm import LLM

    return LLM(str(tiny_dir), engine_config())


def run_app(llm, body, *, config=None, metrics=None, max_waiting: int = 64):
    """Run ``await body(client, front, app)`` against a fresh app over ``llm`` (httpx's ASGI
    transport, the engine thread started and stopped around it); returns the body's result
    and the pool's (free, usable) blocks after shutdown."""
    import httpx

    from hybridkv.server import AsyncLLM, ServerConfig, create_app

    async def main():
        front = AsyncLLM(llm, max_waiting=max_waiting)
        app = create_app(front, config or ServerConfig(model_name="tiny"), metrics)
        front.start()
        try:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # as uvicorn: a bug is a 500
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                result = await asyncio.wait_for(body(client, front, app), 120)
        finally:
            blocks = await front.shutdown()
        return result, blocks

    return asyncio.run(main())


class ServerProcess:
    """``python -m hybridkv serve`` in a subprocess; ``base_url`` once it is ready."""

    def __init__(self, args: list[str], env: dict | None = None, command: str = "serve", wait: bool = True) -> None:
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridkv", command, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.base_url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        if not self._ready.wait(READY_TIMEOUT) or not self.base_url:
            self.kill()
            raise AssertionError(f"server not ready in {READY_TIMEOUT}s: {''.join(self.lines)[-2000:]}")

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on " in line:
                self.base_url = line.split("listening on ", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self, sig=signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Signal the server and wait for it; its exit code (killed and failed past ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit {timeout}s after {sig!r}: {self.stderr[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve(tiny_dir):
    """Start ``hybridkv serve TINY --port 0 ...extra``; every server is stopped at teardown."""
    started: list[ServerProcess] = []

    def start(*extra: str, env: dict | None = None) -> ServerProcess:
        s = ServerProcess([str(tiny_dir), "--port", "0", "--served-model-name", "tiny", *ENGINE_ARGS, *extra], env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
