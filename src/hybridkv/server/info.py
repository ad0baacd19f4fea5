"""What routers and gateways ask a replica about itself, in the shapes they read.

| route                  | who reads it                 | answer                                               |
|------------------------|------------------------------|------------------------------------------------------|
| GET /get_load          | vllm-router (power_of_two, kv_aware), every 5 s | ``{"load": requests unfinished}`` |
| GET /get_server_info   | vllm-router's KV discovery   | ``model_id``, ``kv_block_size``, ``instance_id``, ...  |
| GET /get_model_info    | SGLang-style routers         | ``model_path``, ``tokenizer_path``, ``is_generation``  |
| GET /kv_event_sources  | vllm-router's KV discovery   | ``{"0": {endpoint, replay_endpoint, topic, ...}}``     |
| GET /version           | vLLM clients, probes         | ``{"version": hybridkv's}``                          |

``load`` is what vLLM's own load counter counts: requests admitted and not finished
(queued or running; a request with ``n`` samples or several prompts counts each). The KV
sources are keyed by data-parallel rank (one: ``"0"``) as vLLM's ``KVEventsConfig``; the
endpoints are the publisher's bound ones (``tcp://0.0.0.0:P`` when bound to every
interface, which vllm-router rewrites to the replica's host). Without KV events,
``kv_event_sources`` is None (the route answers 404, as vLLM without events).
"""

from __future__ import annotations

import uuid
from typing import Any

from hybridkv import __version__
from hybridkv.server.config import ServerConfig

__all__ = ["ReplicaInfo"]


class ReplicaInfo:
    """The answers of the routes above for one app (``front``: its AsyncLLM)."""

    def __init__(self, front: Any, config: ServerConfig) -> None:
        self.front = front
        self.config = config
        #: this app's identity for routers (fresh per process, as vLLM's)
        self.instance_id = uuid.uuid4().hex
        engine = front.engine
        source = getattr(front.llm.model, "source", None)
        self.model_path = str(getattr(source, "path", "") or config.model_name)
        self.block_size = engine.config.block_size

    def load(self) -> dict:
        return {"load": self.front.num_unfinished}

    def version(self) -> dict:
        return {"version": __version__}

    def server_info(self) -> dict:
        engine = self.front.engine
        return {
            "model_id": self.config.model_name,
            "model_path": self.model_path,
            "instance_id": self.instance_id,
            "kv_block_size": self.block_size,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.config.max_num_seqs,
            "kv_cache_groups": [{"kind": g.spec.kind, "block_size": g.spec.block_size,
                                 "attention_span": g.spec.attention_span} for g in engine.grouping.groups],
            "version": __version__,
        }

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "served_model_name": self.config.model_name}

    def kv_event_sources(self) -> dict | None:
        pub = self.front.kv_publisher
        if pub is None:
            return None
        return {"0": {
            "publisher": "zmq",
            "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint,
            "topic": pub.topic,
            "encoding": "msgpack",
            "schema_version": 1,  # vLLM 0.33's wire layout (consumers refuse a rank without it)
            "enable_kv_cache_events": True,
            "block_hash_form": pub.hash_form,
        }}
