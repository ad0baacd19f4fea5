import json

from hybridkv.planner.plan import plan_model
from hybridkv.planner.report import format_table, plan_to_dict, render_plan


def test_format_table_aligns_columns():
    lines = format_table(["name", "n"], [["a", "1"], ["long", "100"]], "lr")
    assert lines == ["name    n", "a       1", "long  100"]


def test_scout_report_tables():
    text = render_plan(plan_model("llama4-scout", memory="80GiB", max_model_len="1M"))
    lines = text.splitlines()
    assert lines[0] == "model       meta-llama/Llama-4-Scout-17B-16E (Llama4ForConditionalGeneration)"
    assert lines[1] == "layers      48: 36 chunked_local (8192), 12 full_attention"
    assert "KV cache groups (hybrid layout: group size 12, padding 0 slots = 0 B per request)" in lines
    start = lines.index("KV cache groups (hybrid layout: group size 12, padding 0 slots = 0 B per request)")
    assert lines[start + 1 : start + 6] == [
        "group  attention             layers  padding  blocks/request  tokens/request  bytes/request  layer ids",
        "0      full_attention            12        0          65,536       1,048,576         48 GiB"
        "  3, 7, 11, ..., 47",
        "1      chunked_local (8192)      12        0             640          10,239        480 MiB  0, 4, 8, ..., 44",
        "2      chunked_local (8192)      12        0             640          10,239        480 MiB  1, 5, 9, ..., 45",
        "3      chunked_local (8192)      12        0             640          10,239        480 MiB"
        "  2, 6, 10, ..., 46",
    ]
    assert not any(line.startswith(("state ", "page ", "per request")) for line in lines)  # attention only
    start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    assert lines[start : start + 4] == [
        "layout         groups  layers/group  bytes/block   blocks  blocks/request  concurrency @ 1,048,576"
        "  largest context",
        "hybrid              4            12      768 KiB  109,226          67,456                    1.62x"
        "        1,716,880",
        "full only           1            48        3 MiB   27,306          65,536                    0.42x"
        "          436,880",
        "hybrid / full                                                                                3.89x"
        "            3.93x",
    ]
    assert "warning" not in text


def test_gemma_report_warns_that_one_request_does_not_fit():
    text = render_plan(plan_model("gemma-3-27b", memory="80GiB", max_model_len="1M"))
    assert "padding 8 slots = 193 MiB per request" in text  # 8 * 193 * 131072 = 202_375_168 bytes
    assert text.splitlines()[-1] == (
        "warning: one request of 1,048,576 tokens needs 66,694 blocks but 65,535 are usable; "
        "the largest that fits is 1,030,032 tokens"
    )
    assert "note: max model len 1,048,576 exceeds the model's max_position_embeddings (131,072)" in text


def test_no_hybrid_report_and_unbounded_context():
    text = render_plan(plan_model("mistral-7b", memory="80GiB", hybrid=False))
    assert "KV cache groups (full layout: group size 32, padding 0 slots = 0 B per request)" in text
    assert "in use: full only (--no-hybrid: every layer as full attention): 40,960 blocks" in text
    hybrid_row = next(line for line in text.splitlines() if line.startswith("hybrid  "))
    assert hybrid_row.split()[-1] == "unbounded"


def test_plan_to_dict_is_json_and_exact():
    d = plan_to_dict(plan_model("llama4-scout", memory="80GiB", max_model_len="1M"))
    assert json.loads(json.dumps(d)) == d
    assert d["memory_bytes"] == 85_899_345_920 and d["max_model_len"] == 1_048_576
    assert d["layout_in_use"] == "hybrid" and d["hybrid_enabled"] is True
    assert d["model"]["layer_types"].count("chunked_local_attention") == 36
    h = d["hybrid"]
    assert (h["group_size"], h["num_groups"], h["num_blocks"], h["usable_blocks"]) == (12, 4, 109_226, 109_225)
    assert (h["bytes_per_block"], h["blocks_per_request"], h["max_context_tokens"]) == (786_432, 67_456, 1_716_880)
    assert h["groups"][1]["spec"] == {
        "kind": "chunked_local_attention", "attention_chunk_size": 8192, "block_size": 16, "num_kv_heads": 8,
        "head_size": 128, "dtype": "bfloat16", "page_size_bytes": 65536}
    assert (h["groups"][1]["blocks_per_request"], h["groups"][1]["tokens_per_request"]) == (640, 10_239)
    assert d["max_num_batched_tokens"] == 2048
    assert h["tensors"][0] == {"position": 0, "layers": ["layers.3", "layers.0", "layers.1", "layers.2"],
                               "size_bytes": 109_226 * 65536}
    assert d["full"]["num_blocks"] == 27_306 and len(d["full"]["tensors"]) == 48
    assert abs(d["concurrency_ratio"] - (109_225 / 67_456) / (27_305 / 65_536)) < 1e-12
