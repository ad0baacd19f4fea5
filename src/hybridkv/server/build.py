"""``build_app``: the one factory of ``hybridkv serve``'s app, for embedding it elsewhere.

``hybridkv serve`` is flag parsing around it (:mod:`hybridkv.cli.serve`); Ray Serve
(:mod:`hybridkv.integrations.ray_serve`), gunicorn with uvicorn workers, or a test get the
same app with the same wiring: the engine (its KV pool sized by the
:class:`~hybridkv.engine_config.EngineConfig`: ``num_blocks`` or ``kv_cache_memory``, else
for ``max_num_seqs`` requests of ``max_model_len``), Prometheus metrics on ``/metrics``, KV
cache events on ZMQ when ``server.kv_events`` is set (``enable_kv_events`` turned on for it)
and the engine thread started and stopped by the app's lifespan::

    from hybridkv.server import ServerConfig, build_app

    app = build_app("smollm2-135m", server=ServerConfig(model_name="smollm2", kv_events="tcp://127.0.0.1:0"))
    uvicorn.run(app, host="127.0.0.1", port=8000)   # or: gunicorn -k uvicorn.workers.UvicornWorker 'mod:app'

The model loads here, in the caller's thread (seconds); the engine thread starts when the
app's lifespan starts and stops, with every request aborted and the pool checked, when it
ends: ``app.state.final_blocks`` is then ``(free, usable)``. What SIGTERM does (drain or
abort) is the server's (``uvicorn_server`` in :mod:`hybridkv.cli.http_server`); an embedder
that never runs the lifespan's end leaves the engine thread to die with the process.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from hybridkv.errors import InvalidConfigError
from hybridkv.server.config import ServerConfig

__all__ = ["build_app", "SWITCH_INTERVAL"]

#: the interpreter's thread switch interval while serving (seconds)
SWITCH_INTERVAL = 0.0005
#: how a server keeps a queued request's cached prefix (``serve --queued-prefix``'s default)
SERVER_QUEUED_PREFIX = "refresh"


def build_app(model: Any, *, engine: Any = None, server: ServerConfig | None = None, tokenizer: Any = None):
    """The FastAPI app serving ``model`` (an installed model's name, a ``.gguf`` file, a model
    directory, a :class:`~hybridkv.checkpoint.ModelSource`, or a loaded
    :class:`~hybridkv.engine.llm.LLM`) with ``engine`` (an ``EngineConfig``; None: the defaults)
    and ``server`` (a :class:`ServerConfig`; None: the defaults). ``engine=None`` is
    ``EngineConfig(queued_prefix="refresh")``, ``serve``'s defaults. Typed errors
    (:mod:`hybridkv.errors`) for a bad model, config or endpoint, before anything serves."""
    from hybridkv.engine.llm import LLM
    from hybridkv.engine_config import EngineConfig
    from hybridkv.server.app import create_app
    from hybridkv.server.async_llm import AsyncLLM
    from hybridkv.server.metrics import ServerMetrics

    server = ServerConfig() if server is None else server
    if isinstance(model, LLM):
        llm = model
        if engine is not None or tokenizer is not None:
            raise InvalidConfigError("a loaded LLM has its engine config and tokenizer: give engine= and "
                                     "tokenizer= with a model name or path instead")
        if server.kv_events is not None and not llm.engine.config.enable_kv_events:
            raise InvalidConfigError("KV events need an LLM whose EngineConfig has enable_kv_events=True")
    else:
        cfg = EngineConfig(queued_prefix=SERVER_QUEUED_PREFIX) if engine is None else engine
        if server.kv_events is not None:
            cfg = dataclasses.replace(cfg, enable_kv_events=True)
        llm = LLM(model, cfg, tokenizer=tokenizer)
    # the engine thread holds the GIL between torch calls; a short switch interval lets the
    # event loop send each step's chunks at once instead of after up to 5 ms (Python's default)
    sys.setswitchinterval(SWITCH_INTERVAL)
    publisher = None
    if server.kv_events is not None:
        from hybridkv.server.kv_events import KVEventPublisher

        publisher = KVEventPublisher(
            server.kv_events, group_specs=[g.spec for g in llm.engine.grouping.groups],
            replay_endpoint=server.kv_events_replay, topic=server.kv_events_topic, hash_form=server.kv_events_hash,
        )
    metrics = ServerMetrics(llm.engine, server.model_name)
    front = AsyncLLM(llm, max_waiting=server.max_waiting, retry_after=server.retry_after,
                     metrics=metrics, kv_publisher=publisher)
    return create_app(front, server, metrics)
