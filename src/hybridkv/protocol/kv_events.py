"""KV cache events on the wire: vLLM's format (0.33) over ZeroMQ, for KV-aware routers.

The engine records events in the core (:mod:`hybridkv.core.events`, no dependencies);
this module turns each step's events into one :class:`KVEventBatch`, encodes it with
msgpack (msgspec) and publishes it on a ZMQ PUB socket. The wire types are our own
msgspec Structs declared like vLLM's ``vllm/distributed/kv_events.py``: the same tags,
field names, field order and defaults, so vLLM's decoder reads our bytes and ours reads
vLLM's, byte for byte (checked by ``benchmarks/kv_events_vllm_check.py``).

Wire layout (as vLLM 0.33 sends it):

* a batch is a msgpack array ``[ts, events, data_parallel_rank]`` (``ts``: ``time.time()``);
* each event is a msgpack map tagged by ``"type"``: ``"BlockStored"``, ``"BlockRemoved"``
  or ``"AllBlocksCleared"``; fields left at their default (None) are omitted;
* each PUB message has three frames: topic (utf-8), sequence number (8 bytes, big
  endian, from 0, one per batch) and the payload;
* the replay socket (ROUTER) takes ``[b"", start seq as 8 bytes big endian]`` from a
  DEALER and answers one ``[b"", topic, seq, payload]`` per buffered batch with
  ``seq >= start``, then ``[b"", b"", (-1 as 8 signed bytes), b""]``.

Our events on the wire: block hashes are our chained hashes (:mod:`hybridkv.core.hashing`)
in one of two forms (:data:`HASH_FORMS`, ``--kv-events-hash``): ``"int"`` (the default, as
vLLM's own default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) folds each into a 64-bit
unsigned integer by vLLM's rule, the digest's last 8 bytes read big-endian
(:func:`fold_hash`), which is what Dynamo's indexer and other vLLM consumers decode;
``"bytes"`` sends the whole digest (vLLM with that variable set to 0). ``parent_block_hash``
takes the same form. ``token_ids`` are the tokens of the
stored blocks``token_ids`` are the tokens of the
stored blocks, ``block_size`` per block; ``group_idx`` is our group id and
``kv_cache_spec_kind`` its attention type in vLLM's names ("full_attention",
"sliding_window", "chunked_local_attention"). ``kv_cache_spec_sliding_window`` is the
window of a sliding group and, our choice since vLLM 0.33 has no chunk field (it sends
None there for chunked groups), the chunk size of a chunked-local group; None for full
attention. ``medium`` is "GPU", vLLM's name for the engine's own KV tier ("CPU" there
means an offload tier). A BlockRemoved in a sliding group whose BlockStored named a
window means that block fell out of the engine's cache, not that the prefix is gone
from the full groups.

The publisher is :class:`hybridkv.server.kv_events.KVEventPublisher`; the router's
subscriber :mod:`hybridkv.router.events`.
"""

import time
from typing import Any, Iterable

import msgspec

from hybridkv.core import events as core
from hybridkv.protocol import HASH_FORMS

__all__ = [
    "EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch",
    "MEDIUM_GPU", "END_SEQ", "VLLM_SPEC_KINDS", "HASH_FORMS", "fold_hash", "spec_metadata", "to_wire", "to_batch",
    "encode_batch", "decode_batch",
]

MEDIUM_GPU = "GPU"
#: the replay's end marker (in the sequence-number frame)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: vLLM 0.33's ``KVCacheSpecKind`` values; any other kind goes out as "unknown"
VLLM_SPEC_KINDS = frozenset({
    "full_attention", "mla_attention", "sliding_window", "sliding_window_mla", "mamba",
    "chunked_local_attention", "sink_full_attention", "encoder_only_attention", "cross_attention", "unknown",
})

ExternalBlockHash = bytes | int

_MASK64 = (1 << 64) - 1


def fold_hash(digest: bytes) -> int:
    """A block hash as vLLM's 64-bit integer (``maybe_convert_block_hash``): the digest read as
    a big-endian unsigned int, masked to its low 64 bits, i.e. its last 8 bytes.

    >>> fold_hash(bytes(range(32)))   # bytes 24..31: 0x18191a1b1c1d1e1f
    1736447835066146335
    >>> fold_hash(b"\\xff" * 32) == 2**64 - 1
    True
    """
    return int.from_bytes(digest, "big") & _MASK64


# ------------------------------------------------------------ wire structs (vLLM 0.33 layout)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the wire events: a msgpack map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one batch."""
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One batch from its payload (ours or vLLM's); msgspec.ValidationError if malformed."""
    return _DECODER.decode(payload)


# ------------------------------------------------------------ core events -> wire
def spec_metadata(spec: Any) -> tuple[str, int | None]:
    """(kv_cache_spec_kind, kv_cache_spec_sliding_window) of a group spec on the wire.

    >>> from hybridkv.core.specs import SlidingWindowSpec
    >>> spec_metadata(SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=512))
    ('sliding_window', 512)
    """
    kind = spec.kind if spec.kind in VLLM_SPEC_KINDS else "unknown"
    return kind, spec.attention_span


def _hash_fn(hash_form: str):
    if hash_form == "int":
        return fold_hash
    if hash_form == "bytes":
        return bytes
    raise ValueError(f"hash_form must be one of {HASH_FORMS}, got {hash_form!r}")


def to_wire(event: core.KVCacheEvent, medium: str | None = MEDIUM_GPU, hash_form: str = "int") -> KVCacheEvent:
    """One core event as its wire struct, its hashes in ``hash_form`` (:data:`HASH_FORMS`)."""
    h = _hash_fn(hash_form)
    if type(event) is core.BlockStored:
        kind = event.spec_kind if event.spec_kind in VLLM_SPEC_KINDS else "unknown"
        return BlockStored(
            block_hashes=[h(x) for x in event.block_hashes],
            parent_block_hash=None if event.parent_hash is None else h(event.parent_hash),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=event.group_id,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=event.attention_span,
        )
    if type(event) is core.BlockRemoved:
        return BlockRemoved(block_hashes=[h(event.block_hash)], medium=medium, group_idx=event.group_id)
    if type(event) is core.AllBlocksCleared:
        return AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {event!r:.80}")


def to_batch(events: Iterable[core.KVCacheEvent], ts: float | None = None, data_parallel_rank: int = 0,
             hash_form: str = "int") -> KVEventBatch:
    """One step's core events as a wire batch (``ts`` defaults to ``time.time()``, as vLLM)."""
    return KVEventBatch(
        ts=time.time() if ts is None else ts, events=[to_wire(e, hash_form=hash_form) for e in events],
        data_parallel_rank=data_parallel_rank,
    )
