"""What ``serve`` and ``route`` both speak, so that neither imports the other:

* :mod:`~hybridkv.protocol.openai` - OpenAI's request bodies (pydantic) and their checks;
* :mod:`~hybridkv.protocol.errors` - errors to HTTP statuses and OpenAI's error body;
* :mod:`~hybridkv.protocol.kv_events` - vLLM's KV-event wire format (msgspec);
* :mod:`~hybridkv.protocol.limits` - the request-size limit and the off-loop parsing pool;
* :mod:`~hybridkv.protocol.connections` - the request-read deadline and the connection cap (uvicorn's h11);
* :mod:`~hybridkv.protocol.disconnect` - stopping the work of a client that went away.

Importing this package imports none of them (each needs its extra: pydantic, msgspec, uvicorn).
"""

__all__ = ["HASH_FORMS"]

#: how KV events carry block hashes (:mod:`~hybridkv.protocol.kv_events`): "int", vLLM's default
#: (each hash folded to 64 bits), or "bytes" (the whole digest); here, free of the wire's extra
HASH_FORMS = ("int", "bytes")
