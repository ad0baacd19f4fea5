"""A hit on a state checkpoint is deferred only when *its block* was cached in this step.

vLLM 0.33 keys the deferral on the block's hash (``MambaManager.cached_blocks_this_step``
holds hashes): when two requests computed the same prefix, a hit on the older copy
(written in an earlier step) is deferred because the newer copy with the same hash was
cached in this step, although the older copy's state is already written. hybridkv keys it
on the block (``StateManager.cached_this_step`` holds block ids), so the hit proceeds.
Found by ``benchmarks/vs_vllm.py --state`` (trace qns); the same calls on vLLM 0.33
(block 4, dense) return None for C's allocation.
"""

from __future__ import annotations

import pytest

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager

from tests.support.kv_specs import full, state


@pytest.mark.parametrize("stripe", [True, False])
def test_a_hit_on_an_older_copy_of_a_checkpoint_is_not_deferred(stripe):
    cfg = KVCacheConfig(32, (KVCacheGroup(full(4)), KVCacheGroup(state(4))))
    kv = KVCacheManager(cfg, CacheManagerConfig(max_model_len=64, prefix_cache_retention_interval=None,
                                                stripe_groups=stripe))
    p = list(range(100, 116))
    kv.new_step_starts()  # step 1
    b = kv.make_request("B", p)
    assert kv.allocate_slots(b, 3) is not None  # B: 0 -> 3 (no checkpoint yet)
    b.num_computed_tokens = 3
    a = kv.make_request("A", p[:9])
    assert kv.get_computed_blocks(a)[1] == 0
    assert kv.allocate_slots(a, 8) is not None  # A: 0 -> 8, caches the state after 8 (block x)
    a.num_computed_tokens = 8
    x = kv.get_blocks("A").blocks[1][1]
    kv.new_step_starts()  # step 2
    assert kv.allocate_slots(b, 5) is not None  # B: 3 -> 8, caches the same checkpoint again (block y)
    b.num_computed_tokens = 8
    y = kv.get_blocks("B").blocks[1][1]
    assert y is not x and y.block_hash == x.block_hash
    c = kv.make_request("C", p[:12])
    blocks, hit = kv.get_computed_blocks(c)
    assert hit == 8 and blocks.blocks[1][-1] is x  # the older copy, written in step 1
    assert kv.allocate_slots(c, 12 - hit, hit, blocks) is not None  # vLLM 0.33: None (deferred)
    kv.check_invariants()
