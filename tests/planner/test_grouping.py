import pytest

from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.errors import InvalidArgumentError, InvalidConfigError
from hybridkv.planner.architectures import model_layers
from hybridkv.planner.grouping import GroupSizeOption, group_layers, group_size_options
from hybridkv.planner.presets import load_model_config

M = 1_048_576  # 1M tokens


def preset_specs(name):
    return model_layers(load_model_config(name).config).specs


def test_llama4_scout_four_groups_of_twelve():
    g = group_layers(preset_specs("llama4-scout"), M)
    assert (g.group_size, g.num_groups, g.padding_layers, g.num_layers) == (12, 4, 0, 48)
    assert [grp.spec.kind for grp in g.groups] == ["full_attention"] + ["chunked_local_attention"] * 3
    assert g.groups[0].layers == tuple(range(3, 48, 4))
    # the 36 chunked layers 0,1,2, 4,5,6, ... dealt round-robin into 3 groups
    assert g.groups[1].layers == tuple(range(0, 48, 4))
    assert g.groups[2].layers == tuple(range(1, 48, 4))
    assert g.groups[3].layers == tuple(range(2, 48, 4))
    assert g.page_size_bytes == 65536 and g.bytes_per_block == 12 * 65536
    # full: 1_048_576 / 16 = 65536 blocks; chunked at the default budget 2048:
    # cdiv(8191 + 2048, 16) = 640 blocks each (chunk starts are block-aligned)
    assert g.max_num_batched_tokens == 2048
    assert g.blocks_per_request(M) == 65536 + 3 * 640 == 67456
    # decode only (budget 1): one chunk, 512 blocks
    g1 = group_layers(preset_specs("llama4-scout"), M, max_num_batched_tokens=1)
    assert g1.blocks_per_request(M) == 65536 + 3 * 512
    assert g.padding_bytes_per_request(M) == 0


def test_gemma3_27b_group_size_options_at_1m():
    opts = {o.group_size: o for o in group_size_options(preset_specs("gemma-3-27b"), M)}
    assert sorted(opts) == list(range(10, 53))  # from the rarer type's count (10) to the commoner's (52)
    sliding, full = 193, 65536  # pages per slot: 1023 + 2048 tokens anywhere in a block and M / 16
    assert opts[10] == GroupSizeOption(10, 7, 8, 8 * sliding)  # 6 sliding groups (60 slots) + 1 full
    assert opts[11] == GroupSizeOption(11, 6, 4, 3 * sliding + 1 * full)  # 55 sliding slots, 11 full
    assert opts[13] == GroupSizeOption(13, 5, 3, 3 * full)  # 4 * 13 = 52 sliding, 13 full slots
    assert opts[26] == GroupSizeOption(26, 3, 16, 16 * full)
    assert opts[52] == GroupSizeOption(52, 2, 42, 42 * full)


def test_gemma3_27b_groups_at_1m():
    specs = preset_specs("gemma-3-27b")
    g = group_layers(specs, M)
    assert (g.group_size, g.num_groups, g.padding_layers) == (10, 7, 8)
    sliding_layers = [i for i in range(62) if (i + 1) % 6]
    assert g.groups[0].layers == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59) and g.groups[0].padding == 0
    assert [grp.layers for grp in g.groups[1:]] == [tuple(sliding_layers[i::6]) for i in range(6)]
    assert [len(grp.layers) for grp in g.groups[1:]] == [9, 9, 9, 9, 8, 8]  # 52 = 4 * 9 + 2 * 8
    assert [grp.padding for grp in g.groups] == [0, 1, 1, 1, 1, 2, 2]
    # 8 padded sliding slots, 193 pages each, 131072 bytes a page
    assert g.padding_bytes_per_request(M) == 8 * 193 * 131072 == 202_375_168
    assert g.blocks_per_request(M) == 65536 + 6 * 193


def test_gemma3_27b_short_context_prefers_fewer_padded_slots():
    # at 1024 tokens every slot costs cdiv(1024, 16) = 64 pages: 13 has 3 padded slots (all full), 10 has 8
    g = group_layers(preset_specs("gemma-3-27b"), 1024)
    assert (g.group_size, g.num_groups, g.padding_layers) == (13, 5, 3)
    assert g.groups[0].padding == 3 and [grp.padding for grp in g.groups[1:]] == [0, 0, 0, 0]
    assert g.padding_bytes_per_request(1024) == 3 * 64 * 131072


def spec(kind, **kw):
    common = dict(block_size=16, num_kv_heads=2, head_size=8)
    common.update(kw)
    return {"F": FullAttentionSpec, "S": SlidingWindowSpec, "C": ChunkedLocalAttentionSpec}[kind](**common)


def test_padding_ties_go_to_the_smaller_size():
    full, sw = spec("F"), spec("S", sliding_window=4096)
    # 16 tokens: every slot costs 1 page. size 2: sliding 2 groups, 1 padded slot, 3 groups;
    # size 3: full padded by 1, 2 groups. Same padding -> the null block of size 2 costs less.
    opts = group_size_options([full, full, sw, sw, sw], 16)
    assert opts == [GroupSizeOption(2, 3, 1, 1), GroupSizeOption(3, 2, 1, 1)]
    g = group_layers([full, full, sw, sw, sw], 16)
    assert (g.group_size, g.num_groups) == (2, 3)
    assert g.groups[0].layers == (0, 1) and g.groups[1].layers == (2, 4) and g.groups[2].layers == (3,)


def test_known_budget_chooses_by_exact_capacity():
    # a tie: 3 full + 7 sliding layers, a context inside the window (every slot
    # 32 pages): sizes 3 and 4 pad 2 slots each; 3002 pages hold 7.805 vs 7.802 requests
    full, sw = spec("F"), spec("S", sliding_window=1024)
    specs = [full] * 3 + [sw] * 7
    page = full.page_size_bytes
    three = group_layers(specs, 512, group_size=3)
    four = group_layers(specs, 512, group_size=4)
    assert (three.padding_layers, four.padding_layers) == (2, 2)
    assert three.max_concurrency(3002 * page, 512) == 999 / 128
    assert four.max_concurrency(3002 * page, 512) == 749 / 96
    assert group_layers(specs, 512, memory_bytes=3002 * page).group_size == 3
    # whole blocks: 1000 pages hold 332 / 128 = 249 / 96 (a tie: the smaller size); 3008 pages
    # leave size 3 two pages short of a block, and size 4 holds more (751 / 96 > 1001 / 128)
    assert group_layers(specs, 512, memory_bytes=1000 * page).group_size == 3
    assert group_layers(specs, 512, memory_bytes=3008 * page).group_size == 4
    # brute force over budgets: the choice always holds the most requests of any size
    for pages in range(40, 400, 7):
        chosen = group_layers(specs, 512, memory_bytes=pages * page)
        best = max(group_layers(specs, 512, group_size=k).max_concurrency(pages * page, 512) for k in range(3, 8))
        assert chosen.max_concurrency(pages * page, 512) == best


def test_single_type_is_one_group():
    g = group_layers([spec("F")] * 5, 100)
    assert (g.group_size, g.num_groups, g.padding_layers) == (5, 1, 0)
    assert g.groups[0].layers == (0, 1, 2, 3, 4)


def test_forced_group_size():
    g = group_layers([spec("F")] * 5, 100, group_size=2)
    assert [grp.layers for grp in g.groups] == [(0, 3), (1, 4), (2,)]
    assert g.padding_layers == 1
    with pytest.raises(InvalidArgumentError):
        group_layers([spec("F")], 100, group_size=0)


def test_position_layers_share_tensors_by_position():
    g = group_layers(preset_specs("gemma-3-27b"), M)
    sliding_layers = [i for i in range(62) if (i + 1) % 6]
    # tensor 0 holds layer 0 of every group
    assert g.position_layers(0) == (5,) + tuple(sliding_layers[i] for i in range(6))
    # tensor 8: the 9-layer sliding groups have their 9th layer there, the 8-layer ones a padded slot
    assert g.position_layers(8) == (53, sliding_layers[48], sliding_layers[49], sliding_layers[50],
                                    sliding_layers[51], None, None)
    assert g.position_layers(9) == (59, None, None, None, None, None, None)
    with pytest.raises(InvalidArgumentError):
        g.position_layers(10)


def test_different_page_sizes_are_refused():
    with pytest.raises(InvalidConfigError, match=r"different page sizes cannot share one pool"):
        group_layers([spec("F"), spec("S", sliding_window=8, head_size=16)], 100)


def test_different_block_sizes_are_refused():
    with pytest.raises(InvalidConfigError, match=r"one block size"):
        group_layers([spec("F"), spec("F", block_size=32, head_size=4)], 100)


def test_bad_inputs():
    with pytest.raises(InvalidConfigError, match="at least one layer with a KV cache or a state"):
        group_layers([], 100)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        group_layers([spec("F")], 0)
    with pytest.raises(InvalidConfigError, match="expected a CacheSpec"):
        group_layers(["full"], 10)
