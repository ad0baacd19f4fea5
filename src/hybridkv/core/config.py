"""What a KV cache manager is built from: groups of layers and a number of blocks.

A *KV cache group* is a set of layers with one spec; every group draws blocks
from one shared pool, so a block id names ``page_size_bytes`` in each of the
group's layer tensors. The planner (``hybridkv.planner``) produces these; the core
only reads them.

Example (Llama-4-Scout shaped: 48 layers, 12 NoPE full + 36 chunked, group size 12)::

    KVCacheConfig(num_blocks=10_000, groups=(
        KVCacheGroup(FullAttentionSpec(...), layers 3, 7, ..., 47),
        KVCacheGroup(ChunkedLocalAttentionSpec(...), layers 0, 4, ..., 44),
        KVCacheGroup(ChunkedLocalAttentionSpec(...), layers 1, 5, ..., 45),
        KVCacheGroup(ChunkedLocalAttentionSpec(...), layers 2, 6, ..., 46)))
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core.hashing import HASH_ALGOS
from hybridkv.core.specs import CacheSpec
from hybridkv.errors import InvalidConfigError

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "KVCacheGroup", "KVCacheConfig", "CacheManagerConfig"]

#: tokens a scheduler computes per step unless told otherwise (the planner's default too)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: state checkpoints cached by default: the prompt's last only (vLLM's ``prefix_cache_retention_interval``)
DEFAULT_RETENTION_INTERVAL = 0


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One group: a spec and the names of the layers that use it."""

    spec: CacheSpec
    layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.spec, CacheSpec):
            raise InvalidConfigError(f"KVCacheGroup.spec must be a CacheSpec (attention KV or state), got {self.spec!r}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The groups and the number of blocks in the shared pool (block 0 is the null block)."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        groups = tuple(g if isinstance(g, KVCacheGroup) else KVCacheGroup(g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise InvalidConfigError(
                f"num_blocks must be an int >= 2 (one null block + one usable), got {self.num_blocks!r}"
            )
        if not groups:
            raise InvalidConfigError("a KV cache config needs at least one group")
        block_sizes = {g.spec.block_size for g in groups}
        if len(block_sizes) != 1:
            raise InvalidConfigError(
                f"all KV cache groups must share one block_size, got {sorted(block_sizes)}"
            )

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def specs(self) -> tuple[CacheSpec, ...]:
        return tuple(g.spec for g in self.groups)

    def max_blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Most block ids one request of ``num_tokens`` holds at once, all groups together
        (the sum of each spec's :meth:`~hybridkv.core.specs.KVCacheSpec.max_num_blocks`)."""
        return sum(g.spec.max_num_blocks(num_tokens, max_num_batched_tokens) for g in self.groups)


@dataclass(frozen=True, slots=True)
class CacheManagerConfig:
    """Behaviour switches of a KV cache manager (not the memory layout)."""

    max_model_len: int
    enable_caching: bool = True
    use_eagle: bool = False
    hash_algo: str = "sha256"
    enable_kv_events: bool = False
    #: groups with one spec hold stripes (one block operation per position for all of them);
    #: False gives every group its own manager and blocks, as vLLM does
    stripe_groups: bool = True
    #: which state checkpoints state groups cache (vLLM's ``prefix_cache_retention_interval``):
    #: None every block, 0 the prompt's last block only, k every k tokens (a multiple of the
    #: block size) and the prompt's last (:mod:`hybridkv.core.managers.state`)
    prefix_cache_retention_interval: int | None = DEFAULT_RETENTION_INTERVAL

    def __post_init__(self) -> None:
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len <= 0:
            raise InvalidConfigError(f"max_model_len must be a positive int, got {self.max_model_len!r}")
        for name in ("enable_caching", "use_eagle", "enable_kv_events", "stripe_groups"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        interval = self.prefix_cache_retention_interval
        if interval is not None and (type(interval) is not int or interval < 0):
            raise InvalidConfigError(
                f"prefix_cache_retention_interval must be None or an int >= 0, got {interval!r}"
            )
        if not isinstance(self.hash_algo, str) or self.hash_algo not in HASH_ALGOS:
            raise InvalidConfigError(f"unknown hash algorithm {self.hash_algo!r}; expected one of {sorted(HASH_ALGOS)}")
