"""A Ray Serve request router that picks replicas by ``hybridkv route``'s policy.

Serve calls :meth:`KVAwareRequestRouter.choose_replicas` for each call on a
:class:`~hybridkv.integrations.ray_serve.HybridkvReplica` handle. The call's
``token_ids`` keyword (the prompt's ids, which the ingress rendered) is scored against each
candidate's KV index (:mod:`hybridkv.integrations.ray_index`: fed by the replica's own
events) with :func:`hybridkv.router.policy.make_policy`'s policy (``"hybrid"``: the hit valid
for every KV cache group, sliding windows included; load and share rules as ``route``'s).
The answer is ``[[chosen], [the others]]``: Serve sends to the chosen replica while it has
room (``max_ongoing_requests``), else to the least loaded of the rest. A call without
``token_ids`` (a GET, a render) goes to the replica with the fewest calls in flight, ties in
turn. Configured as::

    RequestRouterConfig(request_router_class="hybridkv.integrations.ray_router:KVAwareRequestRouter",
                        request_router_kwargs={"policy": "hybrid", "max_imbalance": 8, "max_share_ratio": 1.5},
                        request_routing_stats_period_s=1.0)
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from hybridkv.integrations import ray_index  # the module, not its REPLICAS: Ray pickles this module by value
from hybridkv.router.balance import DEFAULT_MAX_SHARE_RATIO, DEFAULT_SHARE_WINDOW, Balance
from hybridkv.router.policy import DEFAULT_MAX_IMBALANCE, make_policy

__all__ = ["KVAwareRequestRouter", "token_ids_of"]


def token_ids_of(pending: Optional[PendingRequest]) -> list[int] | None:
    """The ``token_ids`` keyword of a pending call (None: absent or not a list of ints)."""
    if pending is None:
        return None
    ids = pending.kwargs.get("token_ids")
    if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
        return ids
    return None


class KVAwareRequestRouter(RequestRouter):
    """Serve's router with hybridkv's policy (see the module docstring)."""

    def initialize_state(self, policy: str = "hybrid", max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                         max_share_ratio: float | None = DEFAULT_MAX_SHARE_RATIO,
                         share_window: int = DEFAULT_SHARE_WINDOW) -> None:
        self._policy = make_policy(policy, max_imbalance=max_imbalance, balance=Balance(max_share_ratio, share_window))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ours = [ray_index.REPLICAS.get(r.replica_id.unique_id, r.replica_metadata, r.routing_stats) for r in candidate_replicas]
        # no token ids (a GET, a render): every hit 0, so the least loaded, ties in turn
        chosen, _ = await self._policy.choose(token_ids_of(pending_request), ours)
        first = candidate_replicas[ours.index(chosen)]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        ray_index.REPLICAS.routed(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        ray_index.REPLICAS.completed(replica_id.unique_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ray_index.REPLICAS.keep(r.replica_id.unique_id for r in replicas)
        for r in replicas:  # subscribe now: the first request's events must find the index listening
            ray_index.REPLICAS.get(r.replica_id.unique_id, r.replica_metadata)
