import pytest

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
