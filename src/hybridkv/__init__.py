"""hybridkv: paged KV cache management for LLMs that mix attention types."""

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from hybridkv import errors

__version__ = "0.1.0"

__all__ = [
    "CacheManagerConfig",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "errors",
    "__version__",
]
