"""PagedKVStorage: layout (tensor j shared by layer j of each group) and slot writes."""

from __future__ import annotations

import pytest
import torch

from hybridkv.core.config import KVCacheConfig, KVCacheGroup
from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec
from hybridkv.engine.kv_storage import PagedKVStorage, layer_index
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, InvariantViolation


def test_layout_shares_tensor_j_across_groups():
    s = PagedKVStorage([[3, 7], [0, 4], [1, 5], [2, 6]], block_size=4, num_blocks=10, num_kv_heads=2, head_size=8)
    assert s.num_positions == 2 and s.num_groups == 4 and s.num_layers == 8
    assert s.kv_caches[0].shape == (2, 2, 10, 4, 8)  # [K/V, heads, blocks, block_size, dim]
    assert s.layer_to_group_position[7] == (0, 1)
    assert s.group_of(5) == 2
    assert s.kv_cache(0) is s.kv_cache(3) is s.kv_caches[0]
    assert s.kv_cache(6) is s.kv_caches[1]
    assert s.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4


def test_uneven_groups_get_max_positions():
    s = PagedKVStorage([[0, 1, 2], [3]], 4, 4, 1, 4)
    assert s.num_positions == 3
    assert s.kv_cache(3) is s.kv_caches[0]


def test_write_by_slot_and_read_back():
    s = PagedKVStorage([[0], [1]], block_size=4, num_blocks=6, num_kv_heads=2, head_size=3)
    k = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3)
    v = -k
    slots = torch.tensor([5 * 4 + 1, 2 * 4 + 3, 1 * 4 + 0])
    s.write(1, slots, k, v)
    cache = s.kv_cache(1)
    assert torch.equal(cache[0, :, 5, 1], k[0]) and torch.equal(cache[1, :, 2, 3], v[1])
    assert torch.equal(cache[0, :, 1, 0], k[2])
    # layer 1 lives in tensor 0 of group 1 -- shared with layer 0, so layer 0 sees the same memory
    assert torch.equal(s.kv_cache(0)[0, :, 5, 1], k[0])
    k_flat, v_flat = s.flat_kv(1)
    assert torch.equal(k_flat[slots], k) and torch.equal(v_flat[slots], v)
    both = s.gather(1, slots)  # [2H, n, D]: keys of every head, then values
    assert torch.equal(both[:2].transpose(0, 1), k) and torch.equal(both[2:].transpose(0, 1), v)


def test_null_block_writes_and_out_of_pool_slots_are_refused():
    s = PagedKVStorage([[0]], 4, 3, 1, 2)
    kv = torch.ones(1, 1, 2)
    with pytest.raises(InvariantViolation, match="null block"):
        s.write(0, torch.tensor([3]), kv, kv)
    with pytest.raises(InvariantViolation, match="beyond the pool"):
        s.write(0, torch.tensor([12]), kv, kv)
    assert torch.count_nonzero(s.kv_caches[0]) == 0


def test_bad_shapes_and_layouts():
    s = PagedKVStorage([[0]], 4, 3, 1, 2)
    with pytest.raises(InvalidArgumentError):
        s.write(0, torch.tensor([4]), torch.ones(1, 2, 2), torch.ones(1, 2, 2))
    with pytest.raises(InvalidArgumentError):
        s.write(0, torch.tensor([4, 5]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    with pytest.raises(InvalidArgumentError, match="no KV cache"):
        s.kv_cache(1)
    with pytest.raises(InvalidConfigError, match="more than one"):
        PagedKVStorage([[0, 1], [1]], 4, 3, 1, 2)
    with pytest.raises(InvalidConfigError):
        PagedKVStorage([[0], []], 4, 3, 1, 2)
    with pytest.raises(InvalidConfigError, match=">= 2"):
        PagedKVStorage([[0]], 4, 1, 1, 2)
    with pytest.raises(InvalidConfigError):
        PagedKVStorage([[0]], 0, 3, 1, 2)
    with pytest.raises(InvalidConfigError, match="dtype"):
        PagedKVStorage([[0]], 4, 3, 1, 2, dtype="int4")


def test_fill_blocks_poisons_every_tensor():
    s = PagedKVStorage([[0, 1], [2, 3]], 2, 4, 1, 2, dtype="bfloat16")
    assert s.kv_caches[0].dtype == torch.bfloat16
    s.fill_blocks([2], float("nan"))
    for cache in s.kv_caches:
        assert torch.isnan(cache[:, :, 2]).all() and not torch.isnan(cache[:, :, 1]).any()


def test_from_core_kv_cache_config():
    common = dict(block_size=8, num_kv_heads=2, head_size=16, dtype="float32")
    config = KVCacheConfig(
        num_blocks=20,
        groups=(
            KVCacheGroup(FullAttentionSpec(**common), ("model.layers.3.self_attn",)),
            KVCacheGroup(ChunkedLocalAttentionSpec(attention_chunk_size=20, **common), ("0", "1")),
        ),
    )
    s = PagedKVStorage.from_kv_cache_config(config)
    assert s.groups == ((3,), (0, 1))
    assert s.kv_caches[0].shape == (2, 2, 20, 8, 16) and s.kv_caches[0].dtype == torch.float32
    assert layer_index(5) == 5
    with pytest.raises(InvalidConfigError):
        layer_index("lm_head")
