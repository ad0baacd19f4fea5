"""The KV cache's view of a request: its tokens, computed count and block hashes.

Block hashes are kept up to date as tokens are appended, so a prefix-cache lookup
and ``cache_blocks`` never re-hash: with block_size 4 and 10 tokens the request
holds 2 hashes; ``append_token_ids([10, 11])`` completes the third block and adds
its hash.

Token ids are ints in ``[0, 2**63)`` (hashed as 64-bit ints, int64 in the engine); a
negative id, ``None``, a float, a bool or a str is refused with
:class:`~hybridkv.errors.InvalidArgumentError` before anything changes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Set
from operator import index
from typing import Iterable, Sequence

from hybridkv.core.hashing import BlockHash, HashFn, MultiModalFeature, get_hash_fn, pack_token_ids, seed_hash
from hybridkv.errors import InvalidArgumentError

__all__ = ["Request", "BlockHasher", "check_token_ids", "MAX_TOKEN_ID"]

#: the largest token id (ids are hashed as 64-bit ints; the engine packs them signed)
MAX_TOKEN_ID = (1 << 63) - 1

_LOW_BYTES = bytes(range(128))
_HIGH_BYTE = 0 if sys.byteorder == "big" else 7  # of each packed native id, before any swap


def check_token_ids(token_ids: Iterable[int], what: str) -> tuple[list[int], bytes]:
    """``token_ids`` as (a new list of plain ints in [0, MAX_TOKEN_ID], their packing for
    hashing, see :func:`~hybridkv.core.hashing.pack_token_ids`), or InvalidArgumentError.

    Integer-like values (numpy / torch scalars: ``__index__``, but not bool) become
    ints. Cost, in C passes: types, the packing (which rejects negatives and non-ints;
    hashing reuses it) and a scan of the packed high bytes. Hashing reuses the packed
    ids instead of packing each block, which pays for the check.
    """
    if isinstance(token_ids, (str, bytes, bytearray, Set, Mapping)) or not hasattr(token_ids, "__iter__"):
        raise InvalidArgumentError(f"{what}: token ids must be an ordered sequence of ints (a list, tuple, range, array), got {token_ids!r:.60}")
    ids = list(token_ids)
    if ids and set(map(type, ids)) != {int}:
        ids = [_one_token_id(t, what, i) for i, t in enumerate(ids)]
    try:
        packed = array("Q", ids)
    except OverflowError:
        packed = None
    if packed is None or packed.tobytes()[_HIGH_BYTE::8].translate(None, _LOW_BYTES):
        bad = next(i for i, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidArgumentError(f"{what}: token id {ids[bad]} at index {bad} is outside [0, 2**63)")
    if sys.byteorder == "big":
        packed.byteswap()
    return ids, packed.tobytes()


def _one_token_id(value: object, what: str, i: int) -> int:
    if type(value) is not bool:
        try:
            return index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise InvalidArgumentError(f"{what}: token id at index {i} must be an int, got {value!r:.40}")


class BlockHasher:
    """Computes chained block hashes for one block size and hash algorithm."""

    __slots__ = ("block_size", "hash_fn", "seed")

    def __init__(self, block_size: int, hash_algo: str = "sha256"):
        if type(block_size) is not int or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(hash_algo, str):
            raise InvalidArgumentError(f"hash_algo must be a str, got {hash_algo!r}")
        self.block_size = block_size
        self.hash_fn: HashFn = get_hash_fn(hash_algo)
        self.seed: BlockHash = seed_hash(self.hash_fn)

    def compatible(self, other: "BlockHasher | None") -> bool:
        """True when ``other`` gives the same hashes (same block size and hash function)."""
        return other is self or (
            other is not None and other.block_size == self.block_size and other.hash_fn is self.hash_fn
        )

    def extend(self, request: "Request", packed: bytes | None = None) -> None:
        """Append the hashes of the request's newly completed full blocks.

        ``packed``: the request's first tokens packed by ``pack_token_ids``, when the
        caller has them (a new request); else the new blocks' tokens are packed here.
        Same bytes as :func:`~hybridkv.core.hashing.hash_block_tokens` hashes.
        """
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes)
        end = len(tokens) // bs
        if start >= end:
            return
        step = bs * 8  # bytes of one block's packed ids
        first = 0
        if packed is None or len(packed) < end * step:
            packed = pack_token_ids(tokens[start * bs:end * bs])
            first = start
        parent = hashes[-1] if hashes else self.seed
        fn = self.hash_fn
        keyed = request.lora_name is not None or request.cache_salt is not None or request.mm_features
        for i in range(start, end):
            at = (i - first) * step
            data = parent + packed[at:at + step]
            if keyed:
                extra = request.extra_keys(i, bs)
                if extra:
                    data += repr(extra).encode()
            parent = fn(data)
            hashes.append(parent)


class Request:
    """Tokens and KV-cache progress of one request.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix hits
    included); the caller advances it after each step, to an int in
    ``[0, num_tokens]``. It is a plain attribute: the KV cache manager checks it
    where it reads it (allocate_slots raises InvalidArgumentError, nothing changed;
    its decode fast path checks only the sign, so a float is refused at the next
    call that needs a block). A validating property cost 0.3-0.7 us per
    request-step in ``benchmarks/bench_manager.py`` (+10-27%: a Python-level setter
    on the scheduler's hottest line). Extra keys: ``lora_name``, ``cache_salt`` and
    ``mm_features`` (see :mod:`hybridkv.core.hashing`).
    """

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_hashes",
        "lora_name",
        "cache_salt",
        "mm_features",
        "shared_prefix_boundary",
        "_hasher",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        hasher: BlockHasher | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Iterable[MultiModalFeature] = (),
    ):
        if not isinstance(request_id, str):
            raise InvalidArgumentError(f"a request id must be a str, got {request_id!r:.40}")
        tokens, packed = check_token_ids(prompt_token_ids, f"request {request_id!r}")
        if not tokens:
            raise InvalidArgumentError(f"request {request_id!r} has an empty prompt")
        for name, value in (("lora_name", lora_name), ("cache_salt", cache_salt)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(f"request {request_id!r}: {name} must be a str or None, got {value!r:.40}")
        if hasher is not None and not isinstance(hasher, BlockHasher):
            raise InvalidArgumentError(f"request {request_id!r}: hasher must be a BlockHasher, got {hasher!r:.40}")
        try:
            features = tuple(mm_features)
        except TypeError:
            raise InvalidArgumentError(
                f"request {request_id!r}: mm_features must be an iterable of MultiModalFeature, got {mm_features!r:.40}"
            ) from None
        for f in features:
            if not isinstance(f, MultiModalFeature):
                raise InvalidArgumentError(
                    f"request {request_id!r}: mm_features must hold MultiModalFeature, got {f!r:.40}"
                )
        self.request_id = request_id
        self.all_token_ids: list[int] = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_features = tuple(sorted(features, key=lambda f: f.offset))
        #: where a shared prefix ends that some groups hold further than the hit (a state
        #: group lacks the checkpoint there): state groups cache a checkpoint at it (0: none)
        self.shared_prefix_boundary = 0
        self._hasher = hasher
        if hasher is not None:
            hasher.extend(self, packed)

    def check_num_computed_tokens(self) -> int:
        """``num_computed_tokens`` if it is an int in [0, num_tokens], else InvalidArgumentError."""
        value = self.num_computed_tokens
        if type(value) is not int or not 0 <= value <= len(self.all_token_ids):
            shown = repr(value) if type(value) in (int, float, bool) or value is None else f"a {type(value).__name__}"
            raise InvalidArgumentError(
                f"request {self.request_id!r}: num_computed_tokens must be an int in "
                f"[0, {len(self.all_token_ids)}], got {shown}"
            )
        return value

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def append_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens; hashes of newly full blocks are computed at once.

        A bad id (see the module docstring) raises InvalidArgumentError and appends nothing.
        """
        if type(token_ids) is int and 0 <= token_ids < 1 << 63:  # one sampled token (constant folded)
            self.all_token_ids.append(token_ids)
        elif hasattr(token_ids, "__index__"):
            self.all_token_ids += check_token_ids((token_ids,), f"request {self.request_id!r}")[0]
        else:
            self.all_token_ids += check_token_ids(token_ids, f"request {self.request_id!r}")[0]
        if self._hasher is not None:
            self._hasher.extend(self)

    def extra_keys(self, block_index: int, block_size: int) -> tuple | None:
        """Extra hash keys of block ``block_index`` (None when there are none)."""
        keys: list = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name))
        if block_index == 0 and self.cache_salt is not None:
            keys.append(("salt", self.cache_salt))
        if self.mm_features:
            start = block_index * block_size
            end = start + block_size
            for f in self.mm_features:
                if f.offset < end and f.offset + f.length > start:
                    keys.append(("mm", f.identifier))
        return tuple(keys) if keys else None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens if type(self.num_computed_tokens) is int else '?'}, "
            f"hashes={len(self.block_hashes)})"
        )
