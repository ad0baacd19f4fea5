"""The KV cache's view of a request: its tokens, computed count and block hashes.

Block hashes are kept up to date as tokens are appended, so a prefix-cache lookup
and ``cache_blocks`` never re-hash: with block_size 4 and 10 tokens the request
holds 2 hashes; ``append_token_ids([10, 11])`` completes the third block and adds
its hash.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from hybridkv.core.hashing import BlockHash, HashFn, MultiModalFeature, get_hash_fn, hash_block_tokens, seed_hash
from hybridkv.errors import InvalidArgumentError

__all__ = ["Request", "BlockHasher"]


class BlockHasher:
    """Computes chained block hashes for one block size and hash algorithm."""

    __slots__ = ("block_size", "hash_fn", "seed")

    def __init__(self, block_size: int, hash_algo: str = "sha256"):
        if block_size <= 0:
            raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_fn: HashFn = get_hash_fn(hash_algo)
        self.seed: BlockHash = seed_hash(self.hash_fn)

    def extend(self, request: "Request") -> None:
        """Append the hashes of the request's newly completed full blocks."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes)
        end = len(tokens) // bs
        if start >= end:
            return
        parent = hashes[-1] if hashes else self.seed
        for i in range(start, end):
            parent = hash_block_tokens(self.hash_fn, parent, tokens[i * bs:(i + 1) * bs], request.extra_keys(i, bs))
            hashes.append(parent)


class Request:
    """Tokens and KV-cache progress of one request.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix hits
    included); the caller advances it after each step. Extra keys: ``lora_name``,
    ``cache_salt`` and ``mm_features`` (see :mod:`hybridkv.core.hashing`).
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
        if not prompt_token_ids:
            raise InvalidArgumentError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_features = tuple(sorted(mm_features, key=lambda f: f.offset))
        self._hasher = hasher
        if hasher is not None:
            hasher.extend(self)

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
        """Append sampled tokens; hashes of newly full blocks are computed at once."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
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
            f"computed={self.num_computed_tokens}, hashes={len(self.block_hashes)})"
        )
