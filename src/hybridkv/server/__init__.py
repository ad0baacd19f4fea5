"""``hybridkv serve``'s server: OpenAI's HTTP API over the engine, metrics and KV events.

    from hybridkv.engine.llm import LLM
    from hybridkv.server import AsyncLLM, ServerConfig, create_app

    app = create_app(AsyncLLM(LLM("gemma-3-270m")), ServerConfig(model_name="gemma-3-270m"))

Modules: :mod:`.config` (``ServerConfig``), :mod:`.async_llm` (the engine thread),
:mod:`.submission` (a request's queue on the event loop), :mod:`.live_requests` (a request on
the engine thread), :mod:`.protocol` (request models), :mod:`.serving` (OpenAI's
endpoints, no web framework), :mod:`.errors` (error → HTTP table), :mod:`.metrics`
(Prometheus), :mod:`.kv_events` (ZMQ KV events in vLLM's wire format), :mod:`.app`
(FastAPI). Importing this package imports neither FastAPI nor torch; ``create_app``
imports FastAPI when first used.
"""

from __future__ import annotations

from typing import Any

from hybridkv.server.config import ServerConfig

__all__ = ["AsyncLLM", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from hybridkv.server.app import create_app

        return create_app
    if name == "AsyncLLM":
        from hybridkv.server.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'hybridkv.server' has no attribute {name!r}")
