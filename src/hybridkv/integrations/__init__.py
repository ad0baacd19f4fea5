"""hybridkv inside other serving systems, each behind its own extra.

* :mod:`~hybridkv.integrations.ray_serve` (``[ray]``): replicas of ``serve``'s app on Ray Serve,
  routed by hybridkv's KV-aware policy (:mod:`~hybridkv.integrations.ray_router`, over the
  indexes of :mod:`~hybridkv.integrations.ray_index`);
* :mod:`~hybridkv.integrations.asgi_call`: an ASGI app driven in-process (no socket).

Importing this package imports none of them.
"""
