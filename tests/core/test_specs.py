import pytest

from hybridkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
    dtype_bytes,
)
from hybridkv.errors import InvalidSpecError

SCOUT = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


def test_page_size_counts_k_and_v():
    # 2 (K, V) * 16 tokens * 8 heads * 128 dims * 2 bytes
    assert FullAttentionSpec(**SCOUT).page_size_bytes == 65536
    assert FullAttentionSpec(**{**SCOUT, "dtype": "float32"}).page_size_bytes == 131072
    assert FullAttentionSpec(**{**SCOUT, "dtype": "fp8"}).page_size_bytes == 32768


def test_full_memory_is_whole_context():
    spec = FullAttentionSpec(**SCOUT)
    assert spec.max_num_blocks(1_000_000) == 62500
    assert spec.max_num_blocks(1_000_000, 2048) == 62500
    assert spec.max_memory_usage_bytes(1_000_000, 1) == 62500 * 65536
    assert spec.max_memory_usage_bytes(17) == 2 * 65536


def test_chunked_memory_is_one_chunk_plus_the_budget():
    spec = ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192)
    # 8191 tokens of the current chunk + 2048 new, from a block-aligned chunk start: 640 blocks
    assert spec.max_num_blocks(1_000_000, 2048) == 640
    assert spec.max_num_tokens(1_000_000, 2048) == 10239
    assert spec.max_memory_usage_bytes(1_000_000, 2048) == 640 * 65536
    # shorter than a chunk: the context itself
    assert spec.max_num_blocks(100, 2048) == 7
    # chunk not a multiple of the block: 19 + 8 tokens starting at offset 0 or 4 of a block of 8
    odd = ChunkedLocalAttentionSpec(block_size=8, num_kv_heads=1, head_size=1, attention_chunk_size=20)
    assert odd.max_num_blocks(1000, 8) == 4
    # no budget given: the whole request may be computed in one step
    assert spec.max_num_blocks(1_000_000) == 62500


def test_sliding_memory_is_window_minus_one_plus_the_budget():
    spec = SlidingWindowSpec(**SCOUT, sliding_window=1024)
    # 1023 + 1 tokens starting anywhere in a block -> 65 blocks; with a 1024 budget 129 (as vLLM)
    assert spec.max_num_blocks(131072, 1) == 65
    assert spec.max_num_blocks(131072, 1024) == 129
    assert spec.max_memory_usage_bytes(131072, 1024) == 129 * 65536
    assert spec.max_num_blocks(100, 1024) == 7
    assert spec.attention_span == 1024 and FullAttentionSpec(**SCOUT).attention_span is None


def test_type_id_separates_types_windows_and_chunks():
    a = FullAttentionSpec(**SCOUT)
    b = SlidingWindowSpec(**SCOUT, sliding_window=1024)
    c = SlidingWindowSpec(**SCOUT, sliding_window=512)
    d = ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192)
    e = ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=4096)
    assert len({x.type_id for x in (a, b, c, d, e)}) == 5
    assert a.type_id == FullAttentionSpec(**SCOUT).type_id
    assert d.type_id == "chunked_local_attention_8192_16_65536"


def test_merge_identical_and_reject_different():
    a = ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192)
    assert ChunkedLocalAttentionSpec.merge([a, ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=8192)]) == a
    with pytest.raises(InvalidSpecError):
        KVCacheSpec.merge([a, ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=4096)])
    with pytest.raises(InvalidSpecError):
        KVCacheSpec.merge([])


def test_specs_are_frozen_slotted_and_hashable():
    spec = FullAttentionSpec(**SCOUT)
    with pytest.raises(AttributeError):
        spec.block_size = 32  # type: ignore[misc]
    assert not hasattr(spec, "__dict__")
    assert {spec: 1}[FullAttentionSpec(**SCOUT)] == 1
    assert FullAttentionSpec(**{**SCOUT, "dtype": "bf16"}).dtype == "bfloat16"


@pytest.mark.parametrize(
    "factory",
    [
        lambda: FullAttentionSpec(**{**SCOUT, "block_size": 0}),
        lambda: FullAttentionSpec(**{**SCOUT, "block_size": -16}),
        lambda: FullAttentionSpec(**{**SCOUT, "num_kv_heads": 0}),
        lambda: FullAttentionSpec(**{**SCOUT, "head_size": 2.5}),
        lambda: FullAttentionSpec(**{**SCOUT, "dtype": "float13"}),
        lambda: SlidingWindowSpec(**SCOUT, sliding_window=0),
        lambda: ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=-1),
        lambda: ChunkedLocalAttentionSpec(**SCOUT, attention_chunk_size=True),
    ],
)
def test_invalid_values_raise_invalid_spec_error(factory):
    with pytest.raises(InvalidSpecError):
        factory()


def test_helpers():
    assert cdiv(17, 16) == 2 and cdiv(16, 16) == 1 and cdiv(0, 16) == 0
    assert dtype_bytes("float16") == 2
    with pytest.raises(InvalidSpecError):
        FullAttentionSpec(**SCOUT).max_num_blocks(-1)
