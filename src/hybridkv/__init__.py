"""hybridkv: paged KV cache management for LLMs that mix attention types."""

from hybridkv import errors, planner
from hybridkv.planner import MemoryPlan, plan_model
from hybridkv.core.block_pool import BlockPool, KVCacheBlock
from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from hybridkv.core.hashing import MultiModalFeature
from hybridkv.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from hybridkv.core.request import BlockHasher, Request
from hybridkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheManagerConfig",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "MemoryPlan",
    "MultiModalFeature",
    "PrefixCacheStats",
    "Request",
    "SlidingWindowSpec",
    "errors",
    "plan_model",
    "planner",
    "__version__",
]
