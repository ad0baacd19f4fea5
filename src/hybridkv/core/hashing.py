"""Content addresses for full blocks: a hash chained through the prefix.

``hash(block i) = H(hash(block i-1), tokens of block i, extra keys of block i)``,
with a fixed seed standing in for the parent of block 0. Two requests get the same
hash for block i only if their first ``(i + 1) * block_size`` tokens and extra keys
agree, so a hash names a whole prefix. Partial blocks are never hashed.

Extra keys make equal tokens different when their KV differs: the LoRA adapter
name (every block), the cache salt (first block only: it already chains into all
later ones) and the hashes of multimodal inputs whose placeholder tokens overlap
the block.

Example (block_size 4, tokens 0..9): blocks [0 1 2 3] and [4 5 6 7] are hashed,
[8 9] is not (yet); appending 10 and 11 completes and hashes the third block.

The serialisation is stable across processes: token ids (ints in [0, 2**63)) are
packed as 64-bit little-endian ints and extra keys as ``repr`` of a tuple of str /
int / bytes, so the same prompt gets the same hashes in every run (unlike ``hash()``).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass
from typing import Callable, Sequence

from hybridkv.errors import InvalidArgumentError, InvalidConfigError

__all__ = [
    "BlockHash",
    "HASH_ALGOS",
    "MultiModalFeature",
    "get_hash_fn",
    "hash_block_tokens",
    "pack_token_ids",
    "seed_hash",
]

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

_SEED = b"hybridkv/v1/block-hash-seed"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional extra [fast]

    return xxhash.xxh3_128_digest(data)


HASH_ALGOS: dict[str, HashFn] = {"sha256": _sha256, "xxhash": _xxh3_128}


def get_hash_fn(name: str) -> HashFn:
    """The hash function called ``name``: ``"sha256"`` (default) or ``"xxhash"``."""
    try:
        fn = HASH_ALGOS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        raise InvalidConfigError(f"unknown hash algorithm {name!r}; expected one of {sorted(HASH_ALGOS)}") from None
    if name == "xxhash":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise InvalidConfigError("hash algorithm 'xxhash' needs the xxhash package: pip install hybridkv[fast]") from None
    return fn


def seed_hash(hash_fn: HashFn) -> BlockHash:
    """The fixed parent hash of every request's first block."""
    return hash_fn(_SEED)


_BIG_ENDIAN = sys.byteorder == "big"


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as 64-bit little-endian ints, 8 bytes each, in one C pass.

    Packed unsigned ('Q' converts about 3x faster than 'q'); an id in [0, 2**63) gets
    the bytes of its signed packing. TypeError for a non-int (bools and ``__index__``
    objects pass), OverflowError outside [0, 2**64): callers validate ids first
    (:func:`hybridkv.core.request.check_token_ids`).
    """
    packed = array("Q", token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def hash_block_tokens(
    hash_fn: HashFn,
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    try:
        data = parent + pack_token_ids(token_ids)
    except (TypeError, OverflowError):
        raise InvalidArgumentError(f"token ids must be ints in [0, 2**63), got {list(token_ids)!r:.80}") from None
    if extra_keys:
        data += repr(extra_keys).encode()
    return hash_fn(data)


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """A multimodal input occupying tokens [offset, offset + length) with content hash ``identifier``."""

    offset: int
    length: int
    identifier: str

    def __post_init__(self) -> None:
        for name, low in (("offset", 0), ("length", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise InvalidArgumentError(f"MultiModalFeature.{name} must be an int >= {low}, got {value!r:.40}")
        if not isinstance(self.identifier, str):
            raise InvalidArgumentError(f"MultiModalFeature.identifier must be a str, got {self.identifier!r:.40}")
