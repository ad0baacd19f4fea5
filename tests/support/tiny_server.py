"""The tiny model the server and router tests serve, its engine settings, and an in-process app."""

from __future__ import annotations

import asyncio
from pathlib import Path

__all__ = ["ENGINE_ARGS", "TinyReplica", "engine_config", "make_tiny_dir", "run_app"]

#: the engine settings every server test uses (tiny blocks: many block boundaries, sliding frees)
ENGINE_ARGS = ("--block-size", "4", "--max-num-seqs", "16", "--max-model-len", "256")


def make_tiny_dir(path: Path) -> Path:
    """A tiny Gemma 3 (sliding window 12 + full layers) with a 128-id character tokenizer, in ``path``."""
    from tests.support.hf_tiny import build_tiny
    from tests.support.tiny_tokenizer import write_tokenizer

    build_tiny("gemma3", path)
    write_tokenizer(path)
    return path


def engine_config(**overrides):
    """:data:`ENGINE_ARGS` as an EngineConfig (``overrides`` on top)."""
    from hybridkv.engine.engine import EngineConfig

    kw = dict(block_size=4, max_num_seqs=16, max_model_len=256)
    kw.update(overrides)
    return EngineConfig(**kw)


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


class TinyReplica:
    """A ``hybridkv serve`` of the tiny model on fixed ports (HTTP, KV events, replay), so that it
    can be killed and started again where a router knows it; ``spec`` is its ``--replica``."""

    def __init__(self, model_dir, *extra: str) -> None:
        from tests.support.processes import free_port

        self.model_dir, self.extra = model_dir, extra
        self.http, self.pub, self.replay = free_port(), free_port(), free_port()
        self.proc = None  # a HybridkvProcess once started

    @property
    def spec(self) -> str:
        return f"http://127.0.0.1:{self.http},tcp://127.0.0.1:{self.pub},tcp://127.0.0.1:{self.replay}"

    def start(self, wait: bool = True) -> None:
        from tests.support.processes import HybridkvProcess

        self.proc = HybridkvProcess([str(self.model_dir), "--port", str(self.http), "--served-model-name", "tiny",
                                     *ENGINE_ARGS, *self.extra, "--kv-events", f"tcp://127.0.0.1:{self.pub}",
                                     "--kv-events-replay", f"tcp://127.0.0.1:{self.replay}"], wait=wait)
