"""Consistency checks of a :class:`~hybridkv.core.kv_cache_manager.KVCacheManager` (tests call
them after every step, through its ``check_invariants``).

On top of the coordinator's and the pool's own checks
(:meth:`~hybridkv.core.coordinator.KVCacheCoordinator.check_invariants`, with the pins'
references counted), :func:`check_manager_invariants` checks what only the manager knows:

* every per-type manager knows exactly the requests that hold blocks (the live set);
* no request holding blocks is still pinned (admission releases its pin);
* content: a cached block at index i of a request's table holds that request's block i
  (a stripe's hash is on its lead, in the manager's first group's table).

Each failure raises :class:`~hybridkv.errors.InvariantViolation` naming what disagrees;
nothing is changed. This module does not import ``kv_cache_manager`` (which imports it).
"""

from __future__ import annotations

from typing import Mapping

from hybridkv.core.coordinator import KVCacheCoordinator
from hybridkv.core.prefix_pins import PrefixPins
from hybridkv.core.request import Request
from hybridkv.errors import InvariantViolation

__all__ = ["check_manager_invariants"]


def check_manager_invariants(coordinator: KVCacheCoordinator, live: Mapping[str, Request], pins: PrefixPins) -> None:
    """Raise InvariantViolation if the pool, the tables, the pins or the live set
    (request id -> the request holding blocks) are inconsistent."""
    coord = coordinator
    live_ids = set(live)
    for m in coord.managers:
        if set(m.requests) != live_ids:
            raise InvariantViolation(
                f"manager of groups {m.group_ids} knows {sorted(m.requests)}, live {sorted(live_ids)}"
            )
    if any(rid in pins for rid in live_ids):
        raise InvariantViolation("a request holding blocks is still pinned")
    coord.check_invariants(pins.ref_counts())
    for rid, request in live.items():
        for m in coord.managers:
            for i, block in enumerate(m.state(rid).blocks):
                key = block.block_hash
                if key is not None and (i >= len(request.block_hashes) or key != request.block_hashes[i]):
                    raise InvariantViolation(
                        f"request {rid!r} group {m.group_ids[0]}: block {block.block_id} at {i} "
                        f"caches other content"
                    )
