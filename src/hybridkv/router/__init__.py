"""``hybridkv route``: KV-cache-aware routing across replicas (torch-free).

:class:`~hybridkv.router.index.ReplicaIndex`: one replica's cached blocks from its KV
event stream, scored with the core's own hit rules.
"""

from hybridkv.router.index import ReplicaIndex

__all__ = ["ReplicaIndex"]
