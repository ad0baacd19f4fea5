import pytest

from hybridkv.core.config import KVCacheConfig
from hybridkv.core.specs import FullAttentionSpec, SlidingWindowSpec
from hybridkv.errors import InvalidArgumentError, PoolTooSmallError
from hybridkv.planner.architectures import model_layers
from hybridkv.planner.grouping import group_layers
from hybridkv.planner.plan import max_context_tokens, plan_memory, plan_model
from hybridkv.planner.presets import load_model_config

GiB80 = 80 * 2**30  # 85_899_345_920
M = 2**20  # "1M" = 1_048_576 tokens


def test_llama4_scout_80gib_1m():
    p = plan_model("llama4-scout", memory="80GiB", max_model_len="1M")
    h, f = p.hybrid, p.full
    # hybrid: 4 groups of 12 layers, page 65536 -> a block id costs 12 * 65536 bytes
    assert (h.grouping.group_size, h.grouping.num_groups, h.bytes_per_block) == (12, 4, 786_432)
    assert h.num_blocks == GiB80 // 786_432 == 109_226
    # full + 3 chunked groups of cdiv(8191 + 2048, 16) (a 2048-token prefill chunk on top of a chunk)
    assert h.blocks_per_request == M // 16 + 3 * 640 == 67_456
    assert h.max_concurrency == pytest.approx((109_226 - 1) / 67_456)  # 1.619x
    assert h.max_num_requests == 1
    assert h.max_context_tokens == (109_225 - 3 * 640) * 16 == 1_716_880
    # full fallback: 1 group of 48 -> 48 * 65536 bytes per block
    assert (f.grouping.group_size, f.grouping.num_groups, f.bytes_per_block) == (48, 1, 3_145_728)
    assert f.num_blocks == GiB80 // 3_145_728 == 27_306
    assert f.blocks_per_request == M // 16
    assert f.max_concurrency == pytest.approx(27_305 / 65_536)  # 0.417x: not even one 1M request
    assert f.max_num_requests == 0
    assert f.max_context_tokens == 27_305 * 16 == 436_880
    # chunked layers hold ~10K tokens, not 1M: 36 of 48 layers nearly free -> about 4x
    assert p.concurrency_ratio == pytest.approx((109_225 / 67_456) / (27_305 / 65_536))
    assert 3.85 < p.concurrency_ratio < 4.0
    assert p.context_ratio == pytest.approx(1_716_880 / 436_880)
    # decode-only scheduling (budget 1) holds one chunk: 512 blocks per chunked group
    assert plan_model("llama4-scout", max_model_len="1M", max_num_batched_tokens=1).hybrid.blocks_per_request == (
        M // 16 + 3 * 512
    )
    assert p.layout is h and p.hybrid_enabled


def test_gemma3_27b_80gib_1m():
    p = plan_model("gemma-3-27b", memory="80GiB", max_model_len="1M")
    h, f = p.hybrid, p.full
    # page 2 * 16 * 16 heads * 128 * 2 = 131072; group size 10 -> 1_310_720 bytes per block
    assert (h.grouping.group_size, h.grouping.num_groups, h.bytes_per_block) == (10, 7, 1_310_720)
    assert h.num_blocks == GiB80 // 1_310_720 == 65_536
    # full + 6 sliding groups of (1023 + 2048 - 1) // 16 + 2 = 193 (window + a prefill chunk)
    assert h.blocks_per_request == 65_536 + 6 * 193 == 66_694
    assert h.padding_bytes_per_request == 8 * 193 * 131072 == 202_375_168
    assert h.max_num_requests == 0 and h.max_concurrency == pytest.approx(65_535 / 66_694)
    assert h.max_context_tokens == (65_535 - 6 * 193) * 16 == 1_030_032
    assert f.bytes_per_block == 62 * 131072 == 8_126_464
    assert f.num_blocks == GiB80 // 8_126_464 == 10_570
    assert f.max_context_tokens == 10_569 * 16 == 169_104
    assert p.concurrency_ratio == pytest.approx((65_535 / 66_694) / (10_569 / 65_536))  # 6.09x


def test_mistral_7b_sliding_only_is_unbounded():
    p = plan_model("mistral-7b", memory="80GiB")  # default max_model_len: max_position_embeddings
    assert p.max_model_len == 32_768
    h, f = p.hybrid, p.full
    assert h.bytes_per_block == f.bytes_per_block == 32 * 65536
    assert h.num_blocks == f.num_blocks == GiB80 // (32 * 65536) == 40_960
    assert h.blocks_per_request == (4095 + 2048 - 1) // 16 + 2 == 385
    assert h.max_context_tokens is None  # no layer grows past the window
    assert f.blocks_per_request == 32_768 // 16 == 2048
    assert f.max_context_tokens == 40_959 * 16 == 655_344
    assert p.concurrency_ratio == pytest.approx(2048 / 385)
    assert p.context_ratio is None


def test_gpt_oss_20b_80gib_1m():
    p = plan_model("gpt-oss-20b", memory="80GiB", max_model_len="1M")
    h, f = p.hybrid, p.full
    # page 2 * 16 * 8 * 64 * 2 = 32768; 2 groups of 12
    assert (h.grouping.group_size, h.grouping.num_groups, h.bytes_per_block) == (12, 2, 393_216)
    assert h.num_blocks == GiB80 // 393_216 == 218_453
    assert h.blocks_per_request == 65_536 + 137  # sliding: (127 + 2048 - 1) // 16 + 2 = 137
    assert h.max_context_tokens == (218_452 - 137) * 16 == 3_493_040
    assert f.num_blocks == GiB80 // (24 * 32768) == 109_226
    assert f.max_context_tokens == 109_225 * 16 == 1_747_600
    assert p.concurrency_ratio == pytest.approx((218_452 / 65_673) / (109_225 / 65_536))  # ~2x


def test_llama_3_1_8b_hybrid_equals_full():
    p = plan_model("llama-3.1-8b", memory="80GiB", max_model_len=131_072)
    for layout in (p.hybrid, p.full):
        assert (layout.grouping.group_size, layout.grouping.num_groups) == (32, 1)
        assert layout.num_blocks == GiB80 // (32 * 65536) == 40_960
        assert layout.blocks_per_request == 131_072 // 16 == 8192
        assert layout.max_num_requests == 40_959 // 8192 == 4
    assert p.concurrency_ratio == 1.0 and p.context_ratio == 1.0


def test_kv_cache_config_and_tensors():
    p = plan_model("llama4-scout", memory="80GiB", max_model_len="1M")
    cfg = p.kv_cache_config
    assert isinstance(cfg, KVCacheConfig) and cfg.num_blocks == 109_226 and cfg.block_size == 16
    assert [g.spec.kind for g in cfg.groups] == ["full_attention"] + ["chunked_local_attention"] * 3
    assert cfg.groups[0].layer_names == tuple(f"layers.{i}" for i in range(3, 48, 4))
    assert cfg.groups[1].layer_names[:2] == ("layers.0", "layers.4")
    tensors = p.tensors
    assert len(tensors) == 12
    assert tensors[0].layer_names == ("layers.3", "layers.0", "layers.1", "layers.2")
    assert tensors[11].layer_names == ("layers.47", "layers.44", "layers.45", "layers.46")
    assert {t.size_bytes for t in tensors} == {109_226 * 65536}
    assert sum(t.size_bytes for t in tensors) == p.hybrid.kv_cache_bytes <= GiB80


def test_padded_tensor_positions_are_none():
    p = plan_model("gemma-3-27b", memory="80GiB", max_model_len="1M")
    assert p.tensors[9].layer_names == ("layers.59",) + (None,) * 6
    names = [n for g in p.kv_cache_config.groups for n in g.layer_names]
    assert sorted(names) == sorted(f"layers.{i}" for i in range(62))


def test_no_hybrid_uses_the_full_layout():
    p = plan_model("llama4-scout", memory="80GiB", max_model_len="1M", hybrid=False)
    assert p.layout is p.full and not p.hybrid_enabled
    cfg = p.kv_cache_config
    assert cfg.num_blocks == 27_306 and len(cfg.groups) == 1
    assert isinstance(cfg.groups[0].spec, FullAttentionSpec) and len(cfg.groups[0].layer_names) == 48
    assert len(p.tensors) == 48


def scout(**kw):
    return model_layers(load_model_config("llama4-scout").config, **kw)


def test_budget_too_small():
    # 1 MiB // 786_432 = 1 block: only the null block
    with pytest.raises(PoolTooSmallError, match=r"1 MiB holds 1 block\(s\) of 768 KiB in the hybrid layout"):
        plan_memory(scout(), 2**20, 1000)
    # 2 blocks is enough for hybrid; the full layout then holds 1_572_864 // 3_145_728 = 0 blocks
    p = plan_memory(scout(), 2 * 786_432, 16)
    assert p.hybrid.num_blocks == 2 and p.full.num_blocks == 0
    assert p.full.usable_blocks == 0 and p.full.max_context_tokens == 0 and p.concurrency_ratio is None
    with pytest.raises(PoolTooSmallError, match="full layout"):
        plan_memory(scout(), 2 * 786_432, 16, hybrid=False)


def test_bad_sizes():
    with pytest.raises(InvalidArgumentError, match=r"unknown memory unit 'XB' in '80XB'"):
        plan_model("llama4-scout", memory="80XB")
    with pytest.raises(InvalidArgumentError, match=r"token count must be positive"):
        plan_model("llama4-scout", max_model_len="0")
    with pytest.raises(InvalidArgumentError, match=r"memory budget must be a positive int"):
        plan_memory(scout(), 0, 10)


def test_max_context_is_the_last_length_that_fits():
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1)
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, sliding_window=100)
    g = group_layers([full, sw], 10, max_num_batched_tokens=1)
    # decode only: sliding holds 99 + 1 tokens from anywhere in a block <= 8 blocks;
    # with 20 usable: cdiv(L, 16) <= 12 -> L = 192
    assert max_context_tokens(g, 20) == 192
    assert g.blocks_per_request(192) == 12 + 8 and g.blocks_per_request(193) == 13 + 8
    # a 64-token budget: 99 + 64 tokens from anywhere in a block -> up to 12 sliding blocks, but
    # never more than the request's own: L = 160 holds 10 + 10, L = 161 needs 11 + 11
    g64 = group_layers([full, sw], 10, max_num_batched_tokens=64)
    assert max_context_tokens(g64, 20) == 160 and g64.blocks_per_request(161) == 22
    assert max_context_tokens(g64, 24) == 12 * 16 and g64.blocks_per_request(193) == 13 + 12
    assert max_context_tokens(g, 0) == 0
    assert max_context_tokens(g, 1) == 0  # one token needs a block in each of the 2 groups
    assert max_context_tokens(g, 2) == 16
    only_sw = group_layers([sw, sw], 10, max_num_batched_tokens=1)
    assert max_context_tokens(only_sw, 8) is None  # 8 blocks hold any length
    assert max_context_tokens(only_sw, 7) == 7 * 16


def test_plan_model_block_size_and_dtype():
    p = plan_model("llama4-scout", memory="80GiB", max_model_len="1M", block_size=32, dtype="fp8")
    # page = 2 * 32 * 8 * 128 * 1 = 65536 again; full needs 1M / 32 = 32768, chunked cdiv(8191 + 2048, 32) = 320
    assert p.hybrid.bytes_per_block == 12 * 65536
    assert p.hybrid.blocks_per_request == 32_768 + 3 * 320


def test_core_manager_built_from_the_plan_holds_the_planned_requests():
    from hybridkv.core.config import CacheManagerConfig
    from hybridkv.core.kv_cache_manager import KVCacheManager

    # tiny Llama-4 shape: 8 layers, every 4th NoPE/full, chunk 32; page 2 * 16 * 1 * 4 * 2 = 256 bytes
    cfg = {"architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 8, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4, "attention_chunk_size": 32}
    L = 256
    # 60 blocks of 2 layers * 256 bytes; the scheduler prefills 16 tokens a step
    p = plan_memory(model_layers(cfg), 60 * 2 * 256, L, max_num_batched_tokens=16)
    h = p.hybrid
    assert (h.grouping.group_size, h.num_blocks) == (2, 60)
    assert h.blocks_per_request == 256 // 16 + 3 * -(-(31 + 16) // 16) == 25  # full 16 + 3 chunked groups of 3
    assert h.max_num_requests == 59 // 25 == 2
    assert p.full.num_blocks == 60 * 2 * 256 // (8 * 256) == 15 and p.full.max_num_requests == 0

    mgr = KVCacheManager(p.kv_cache_config, CacheManagerConfig(max_model_len=L, enable_caching=False))
    assert mgr.num_free_blocks == h.usable_blocks == 59
    for r in range(h.max_num_requests):
        before = mgr.num_free_blocks
        req = mgr.make_request(f"r{r}", list(range(r * 1000, r * 1000 + L)))
        while req.num_computed_tokens < L:  # chunked prefill, one block at a time
            assert mgr.allocate_slots(req, 16) is not None
            req.num_computed_tokens += 16
            assert before - mgr.num_free_blocks <= h.blocks_per_request
    mgr.check_invariants()
