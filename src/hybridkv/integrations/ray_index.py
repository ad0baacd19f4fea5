"""The KV indexes of Ray Serve replicas, as ``hybridkv route`` keeps them, in the ingress process.

Ray Serve runs a deployment handle's request router in the process that holds the handle
(here the ingress replica), on a thread of its own. :class:`RayReplicas` is what that
router reads: one :class:`~hybridkv.router.replica.Replica` per Serve replica id (its index
fed by a :class:`~hybridkv.router.events.ReplicaEvents` thread subscribed to the KV events
the replica advertised in its metadata), its in-flight count, and the routing stats the
replica last reported. The ingress reads the same object (:data:`REPLICAS`) to answer
``GET /hybridkv/replicas``; it lives in this module, not the router's, because Ray ships the
router class to the process by value (and may ship the ingress class so), whose module globals
would then be copies: both reach it as ``ray_index.REPLICAS``, through the module, which is
always imported by name. Every method is safe from any thread. No Ray import.

Metadata a replica advertises (``record_replica_metadata``)::

    {"kv_events": "tcp://10.0.0.5:40123", "kv_events_replay": "tcp://10.0.0.5:40124", "block_size": 16}
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

from hybridkv.router.events import ReplicaEvents
from hybridkv.router.replica import Replica, ReplicaSpec

__all__ = ["RayReplicas", "REPLICAS"]


class RayReplicas:
    """Serve replica id -> its routing state (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, Replica] = {}
        self._stats: dict[str, dict] = {}

    def get(self, replica_id: str, metadata: Mapping[str, Any] | None = None,
            stats: Mapping[str, Any] | None = None) -> Replica:
        """The replica's state, created on first sight; its events subscribed as soon as its
        metadata names them (on first sight, or later if its metadata came later)."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            meta = dict(metadata or {})
            if replica is None:
                replica = self._replicas[replica_id] = Replica(replica_id, ReplicaSpec(f"ray-serve://{replica_id}"))
            if replica.events is None and meta.get("kv_events"):
                replica.spec = ReplicaSpec(replica.spec.url, meta["kv_events"], meta.get("kv_events_replay"))
                replica.events = ReplicaEvents(
                    replica_id, replica.spec.events, replica.spec.replay, on_batch=replica.on_events,
                    on_reset=lambda why, r=replica: r.reset_index(why),
                )
            if stats:
                self._stats[replica_id] = dict(stats)
            return replica

    def routed(self, replica_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None:
                replica.in_flight += 1
                replica.num_requests += 1

    def completed(self, replica_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None and replica.in_flight > 0:
                replica.in_flight -= 1

    def keep(self, replica_ids: Iterable[str]) -> None:
        """Forget (and unsubscribe from) every replica not in ``replica_ids``."""
        keep = set(replica_ids)
        with self._lock:
            gone = [self._replicas.pop(r) for r in list(self._replicas) if r not in keep]
            for replica in gone:
                self._stats.pop(replica.name, None)
        for replica in gone:
            if replica.events is not None:
                replica.events.close()

    def snapshot(self) -> list[dict]:
        """Per replica: id, in flight, requests routed, index blocks, KV endpoints, last stats."""
        with self._lock:
            replicas = list(self._replicas.values())
            stats = {k: dict(v) for k, v in self._stats.items()}
        return [{"replica_id": r.name, "in_flight": r.in_flight, "num_requests": r.num_requests,
                 "index_blocks": r.num_blocks, "kv_events": r.spec.events, "stats": stats.get(r.name, {})}
                for r in replicas]

    def close(self) -> None:
        self.keep(())


#: the ingress process's one registry (the router writes it, the ingress reads it)
REPLICAS = RayReplicas()
