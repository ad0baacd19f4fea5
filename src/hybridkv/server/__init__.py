"""``hybridkv serve``'s server: OpenAI's HTTP API over the engine, metrics and KV events.

    from hybridkv.server import ServerConfig, build_app

    app = build_app("gemma-3-270m", server=ServerConfig(model_name="gemma-3-270m"))   # what `serve` runs

``build_app`` (:mod:`.build`) wires what ``hybridkv serve`` wires: the engine, metrics, KV
events; ``create_app`` is the bare app over an :class:`AsyncLLM` you made.

Modules: :mod:`.build` (``build_app``), :mod:`.config` (``ServerConfig``), :mod:`.async_llm` (the engine thread),
:mod:`.submission` (a request's queue on the event loop), :mod:`.live_requests` (a request on
the engine thread), :mod:`.protocol` (request models), :mod:`.serving` (OpenAI's
endpoints, no web framework), :mod:`.errors` (error → HTTP table), :mod:`.metrics`
(Prometheus), :mod:`.kv_events` (ZMQ KV events in vLLM's wire format), :mod:`.render`
(vLLM's render routes), :mod:`.app` (FastAPI). Importing this package imports neither FastAPI nor torch; ``create_app`` and
``build_app`` import them when first used.
"""

from __future__ import annotations

from typing import Any

from hybridkv.server.config import ServerConfig

__all__ = ["AsyncLLM", "ServerConfig", "build_app", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from hybridkv.server.build import build_app

        return build_app
    if name == "create_app":
        from hybridkv.server.app import create_app

        return create_app
    if name == "AsyncLLM":
        from hybridkv.server.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'hybridkv.server' has no attribute {name!r}")
