import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples

from hybridkv.errors import InvalidArgumentError, TraceFormatError
from hybridkv.scheduler.fake_runner import fake_token
from hybridkv.scheduler.workloads import dump_trace, load_trace, make_workload, parse_trace_lines


def test_trace_lines_with_prompts_and_shared_prefixes():
    reqs = parse_trace_lines([
        '{"arrival": 3, "prompt": [1, 2, 3], "output_len": 4, "id": "x"}',
        "# comment",
        "",
        '{"arrival": 0, "prompt_len": 20, "prefix_id": "sys", "prefix_len": 12, "output_len": 2}',
        '{"arrival": 1, "prompt_len": 15, "prefix_id": "sys", "prefix_len": 12, "output_len": 2}',
    ])
    assert [r.request_id for r in reqs] == ["req-1", "req-2", "x"]  # sorted by arrival
    assert reqs[2].prompt_token_ids == (1, 2, 3) and reqs[2].output_len == 4
    a, b = reqs[0].prompt_token_ids, reqs[1].prompt_token_ids
    assert len(a) == 20 and len(b) == 15 and a[:12] == b[:12] and a[12:15] != b[12:]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"prompt": [1], "output_len": 0}', "output_len"),
        ('{"prompt": [], "output_len": 1}', "prompt"),
        ('{"prompt": [1, -2], "output_len": 1}', "prompt"),
        ('{"prompt_len": 5, "output_len": 1, "prefix_len": 3}', "prefix_id"),
        ('{"prompt_len": 5, "prefix_id": "a", "prefix_len": 9, "output_len": 1}', "prefix_len 9 > prompt_len 5"),
        ('{"output_len": 1}', "prompt_len"),
        ('{"prompt": [1], "output_len": 1, "colour": "red"}', "unknown key"),
        ('{"prompt": [1], "output_len": 1, "arrival": -1}', "arrival"),
    ],
)
def test_bad_line_names_its_number(line, message):
    good = '{"prompt": [1, 2], "output_len": 1}'
    with pytest.raises(TraceFormatError) as err:
        parse_trace_lines([good, "", line], path="t.jsonl")
    assert err.value.line == 3
    assert str(err.value).startswith("t.jsonl:3: ") and message in str(err.value)


def test_duplicate_ids_and_empty_trace():
    with pytest.raises(TraceFormatError, match="2: duplicate id"):
        parse_trace_lines(['{"id": "a", "prompt": [1], "output_len": 1}'] * 2)
    with pytest.raises(TraceFormatError, match="no request"):
        parse_trace_lines(["# nothing"])


def test_round_trip_through_a_file(tmp_path):
    reqs = make_workload("sharegpt", num_requests=5, max_model_len=4096, seed=1)
    path = tmp_path / "t.jsonl"
    path.write_text(dump_trace(reqs))
    assert load_trace(path) == reqs
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_workloads_are_seeded_and_fit_max_model_len():
    for name in ("long-doc", "chat", "sharegpt"):
        a = make_workload(name, num_requests=20, max_model_len=8192, chunk=512, seed=3)
        assert a == make_workload(name, num_requests=20, max_model_len=8192, chunk=512, seed=3)
        assert a != make_workload(name, num_requests=20, max_model_len=8192, chunk=512, seed=4)
        assert len(a) == 20
        assert all(r.prompt_len + r.output_len <= 8192 for r in a)
    with pytest.raises(InvalidArgumentError):
        make_workload("nope")


def test_long_docs_share_system_prompts_of_two_chunks():
    reqs = make_workload("long-doc", num_requests=12, max_model_len=65536, chunk=512, seed=0)
    prefixes = {r.prompt_token_ids[:1024] for r in reqs}
    assert len(prefixes) <= 3


def test_chat_turns_extend_the_previous_turn_and_its_fake_output():
    reqs = make_workload("chat", num_requests=10, max_model_len=65536, seed=0)
    t0 = next(r for r in reqs if r.request_id == "chat-0-0")
    t1 = next(r for r in reqs if r.request_id == "chat-0-1")
    reply = tuple(fake_token("chat-0-0", k) for k in range(t0.output_len))
    assert t1.prompt_token_ids[: t0.prompt_len + t0.output_len] == t0.prompt_token_ids + reply
    assert t1.arrival_step > t0.arrival_step + t0.output_len


# ---------------------------------------------------------------- bad input, bounds, termination
@settings(max_examples=examples(60), deadline=None)
@given(
    name=st.sampled_from(["long-doc", "chat", "sharegpt"]),
    max_model_len=st.one_of(st.integers(2, 40), st.integers(41, 5000), st.sampled_from([231, 232, 233, 2048, 131072])),
    chunk=st.one_of(st.integers(1, 64), st.sampled_from([256, 4096, 8192])),
    num_requests=st.integers(1, 12),
    seed=st.integers(0, 2**32),
)
def test_every_workload_terminates_and_fits(name, max_model_len, chunk, num_requests, seed):
    # chat used to loop forever when no first turn (>= 232 tokens) fitted max_model_len
    reqs = make_workload(name, num_requests=num_requests, max_model_len=max_model_len, chunk=chunk, seed=seed)
    assert len(reqs) == num_requests and len({r.request_id for r in reqs}) == num_requests
    for r in reqs:
        assert r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= max_model_len


def test_fit_cuts_the_prompt_first():
    from hybridkv.scheduler.workloads import _fit

    assert _fit(3000, 100, 2048) == (1948, 100)
    assert _fit(300, 64, 16) == (8, 8)
    assert _fit(10, 5, 100) == (10, 5)  # fits: unchanged
    assert _fit(1, 1, 2) == (1, 1) and _fit(5, 9, 2) == (1, 1)


@pytest.mark.parametrize("kwargs", [dict(max_model_len=1), dict(max_model_len=0), dict(num_requests=0),
                                    dict(chunk=0), dict(num_requests=True)])
def test_make_workload_refuses_bad_sizes(kwargs):
    with pytest.raises(InvalidArgumentError):
        make_workload("chat", **kwargs)


def test_a_workload_too_big_to_hold_is_refused_early():
    with pytest.raises(InvalidArgumentError, match=r"sharegpt x10000000 would hold about [\d,]+ prompt tokens; the "
                                                    r"simulator holds at most 33,554,432"):
        make_workload("sharegpt", num_requests=10_000_000, max_model_len=131072)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"prompt": [1], "output_len": 1}\n\xff\xfe\n', "2: not UTF-8 text (byte 0xff at column 1)"),
        ("[" * 50_000 + "]" * 50_000, "1: JSON nested too deeply"),
        ('{"prompt_len": 100000000000, "output_len": 1}', "1: a prompt of 100,000,000,000 tokens exceeds max_model_len 4,096"),
        ('{"prompt": [1, 2, 3], "output_len": 1}', None),
        ('{"prompt": [1, 2, 3, 4, 5], "output_len": 1}', "a prompt of 5 tokens exceeds max_model_len 4"),
        ('{"prompt": [1], "output_len": 1, "arrival": 1000001}', "'arrival' 1,000,001 is past the last step"),
        ('{"prompt": [1], "output_len": 1, "prefix_len": 1}', "give either 'prompt' or 'prompt_len'"),
        ('{"prompt_len": 20000000, "output_len": 1}\n{"prompt_len": 20000000, "output_len": 1}',
         "2: the trace holds more than 33,554,432 prompt tokens"),
    ],
    ids=["binary", "nested", "prompt_len 1e11", "fits", "prompt over", "arrival", "prompt+prefix_len", "total"],
)
def test_trace_bounds_are_checked_before_prompts_are_made(tmp_path, raw, message):
    path = tmp_path / "t.jsonl"
    path.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    limit = 4 if "[1, 2, 3" in str(raw) else (None if "20000000" in str(raw) else 4096)
    if message is None:
        assert load_trace(path, max_model_len=limit)[0].prompt_len == 3
        return
    with pytest.raises(TraceFormatError) as err:
        load_trace(path, max_model_len=limit)
    assert message in str(err.value) and "\n" not in str(err.value)


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True), st.text(max_size=5),
    st.lists(st.integers(-2, 10**20), max_size=4), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(sorted(
    ["id", "arrival", "prompt", "prompt_len", "prefix_id", "prefix_len", "output_len", "x"])), _VALUES, max_size=5),
    min_size=1, max_size=3))
def test_random_trace_lines_parse_or_fail_in_one_line(objs):
    lines = [json.dumps(o) for o in objs]
    try:
        reqs = parse_trace_lines(lines, "r.jsonl", max_model_len=4096)
    except TraceFormatError as exc:
        assert str(exc).startswith("r.jsonl:") and "\n" not in str(exc)
    else:
        assert len(reqs) == len(objs)
        for r in reqs:
            assert 1 <= r.prompt_len <= 4096 and r.output_len >= 1 and 0 <= r.arrival_step <= 1_000_000
            assert all(isinstance(t, int) and t >= 0 for t in r.prompt_token_ids)
