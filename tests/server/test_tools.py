"""Tool calls on chat (``tools`` + ``tool_choice``, vLLM's semantics; :mod:`hybridkv.server.tools`).

The usual tiny tokenizer has no braces or quotes, so the calls run on the tiny Gemma 3's
weights with a 128-id character tokenizer of JSON's characters (``json_llm``) and a template
that prints the tools, the assistant's calls and the tool results it is given. ``required``
and named calls are constrained by structured outputs: their arguments must parse and
validate against the tool's schema whatever the random model prefers. The Hermes parser
(``tool_choice: "auto"``) is checked on generated texts (hypothesis) and on the wire through
a server whose output is forced (structured outputs' regex) to hold Hermes calls.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("llguidance")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybridkv.protocol.openai import ChatCompletionRequest, chat_messages, chat_tools  # noqa: E402
from hybridkv.server import ServerConfig  # noqa: E402
from hybridkv.server.tools import parse_hermes, HermesParser  # noqa: E402
from hybridkv.tokenizer.prompts import encode_prompt  # noqa: E402

from tests.support.tiers import examples, scaled  # noqa: E402
from tests.support.tiny_server import engine_config, run_app  # noqa: E402

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "addtwonumbers"}]
TEMPLATE = (
    "{% if tools %}<|system|>TOOLS{% for t in tools %}:{{ t['function']['name'] }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}CALL:{{ c['function']['name'] }}:{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% if m.tool_call_id %}ID:{{ m.tool_call_id }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
MODE = {"type": "object", "properties": {"mode": {"enum": ["up", "down"]}}, "required": ["mode"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": ADD}},
         {"type": "function", "function": {"name": "turn", "parameters": MODE}}]


def _valid(name: str, args: dict) -> bool:
    if name == "add":
        return set(args) == {"a", "b"} and type(args["a"]) is int and 0 <= args["a"] <= 9 and type(args["b"]) is bool
    return name == "turn" and args in ({"mode": "up"}, {"mode": "down"})


@pytest.fixture(scope="module")
def json_llm(tiny_dir, tmp_path_factory):
    """The tiny Gemma 3 with a character tokenizer that spells JSON but no whitespace (llguidance lets JSON
    hold any, which a random model takes forever to leave), and :data:`TEMPLATE`."""
    from tests.support import tiny_tokenizer as tt
    from hybridkv.engine.llm import LLM

    path = tmp_path_factory.mktemp("tiny-json")
    for f in tiny_dir.iterdir():
        if f.is_file() and not f.name.startswith("tokenizer"):
            shutil.copy(f, path / f.name)
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]\":,.-_<>/")
    chars += [chr(c) for c in range(0x3b1, 0x3b1 + 128 - len(tt.SPECIALS) - len(chars))]
    old = tt.CHARS
    tt.CHARS = chars
    try:
        tt.write_tokenizer(path, TEMPLATE)
    finally:
        tt.CHARS = old
    return LLM(str(path), engine_config())


def _post_all(llm, bodies, config=None):
    async def run(client, front, app):
        return [await client.post(CHAT, json=b) for b in bodies]

    out, (free, usable) = run_app(llm, run, config=config)
    assert free == usable
    return out


def _stream(llm, body, config=None) -> list[dict]:
    async def run(client, front, app):
        async with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            return [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                    if line.startswith("data: ") and line != "data: [DONE]"]

    return run_app(llm, run, config=config)[0]


def _reassemble(chunks: list[dict]) -> tuple[str | None, list[dict], str]:
    """The content, the calls and the finish reason of a streamed choice 0, as a client rebuilds them."""
    content, calls, reason = "", {}, None
    for c in chunks:
        [ch] = c["choices"]
        d = ch["delta"]
        content += d.get("content") or ""
        for t in d.get("tool_calls", []):
            call = calls.setdefault(t["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = t.get("id", call["id"])
            call["name"] += t.get("function", {}).get("name", "")
            call["arguments"] += t["function"].get("arguments", "")
        reason = ch["finish_reason"] or reason
    return (content if content.strip() else None), [calls[i] for i in sorted(calls)], reason


def _wire_calls(message: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]


def test_named_and_required_calls_validate_and_stream_the_same(json_llm):
    named = {"messages": MSG, "tools": TOOLS, "max_tokens": 80, "temperature": 0,
             "tool_choice": {"type": "function", "function": {"name": "add"}}}
    close = json_llm.tokenizer.encode("]", add_special_tokens=False)[-1]  # a random model rarely ends the array
    required = {**named, "tool_choice": "required", "max_tokens": 200, "logit_bias": {str(close): 100}}
    seeded = [{**required, "temperature": 1.0, "seed": s} for s in range(scaled(3, 1))]
    responses = _post_all(json_llm, [named, required, *seeded])
    for r in responses:
        assert r.status_code == 200, r.text
        [choice] = r.json()["choices"]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] is None, choice
        assert msg["tool_calls"], msg
        for call in msg["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 5
            assert _valid(call["function"]["name"], json.loads(call["function"]["arguments"])), call
    assert [c["function"]["name"] for c in responses[0].json()["choices"][0]["message"]["tool_calls"]] == ["add"]
    ids = [c["id"] for r in responses for c in r.json()["choices"][0]["message"]["tool_calls"]]
    assert len(set(ids)) == len(ids)
    for body, r in [(named, responses[0]), (required, responses[1])]:
        content, calls, reason = _reassemble(_stream(json_llm, body))
        assert content is None and reason == "tool_calls"
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == _wire_calls(r.json()["choices"][0]["message"])
        assert all(c["id"].startswith("call_") for c in calls)


def test_auto_with_hermes_parses_calls_streamed_or_not(json_llm):
    # the output is forced to "ok <tool_call>{...}</tool_call>" with a random add call, then more text
    forced = ('ok<tool_call>{"name":"add","arguments":{"a":[0-9],"b":(true|false)}}</tool_call>'
              '<tool_call>{"name":"turn","arguments":{"mode":"(up|down)"}}</tool_call>[a-z]{1,3}')
    forced = forced.replace("{", r"\{").replace("}", r"\}").replace(r"\{1,3\}", "{1,3}")
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 220, "temperature": 0,
            "structured_outputs": {"regex": forced}}
    config = ServerConfig(model_name="tiny", tool_call_parser="hermes")
    [r, unset] = _post_all(json_llm, [body, {k: v for k, v in body.items() if k != "tool_choice"}], config)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert msg["content"].startswith("ok") and "<tool_call>" not in msg["content"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["add", "turn"]
    assert all(_valid(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"])
    assert unset.json()["choices"][0]["message"]["tool_calls"]  # tools + a parser: unset means "auto"
    content, calls, reason = _reassemble(_stream(json_llm, body, config))
    assert content == msg["content"] and reason == "tool_calls"
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == _wire_calls(msg)


def test_none_and_no_tools_leave_text_alone_and_unset_without_a_parser_is_refused(json_llm):
    free = {"messages": MSG, "max_tokens": 12, "temperature": 0}
    [plain, none, empty, unset] = _post_all(json_llm, [
        free, {**free, "tools": TOOLS, "tool_choice": "none"}, {**free, "tools": []}, {**free, "tools": TOOLS}])
    # tools with tool_choice unset mean "auto" (vLLM's default): without a parser a 400, never ignored
    assert unset.status_code == 400 and unset.json()["error"]["param"] == "tool_choice"
    for r in (plain, none, empty):
        assert r.status_code == 200, r.text
        assert "tool_calls" not in r.json()["choices"][0]["message"]
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert empty.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    # the tools are rendered (vLLM's "none"): a longer prompt than without
    assert none.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    assert empty.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_tool_calls_and_results_reach_the_template(json_llm):
    messages = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": true}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "42"},
    ]
    req = ChatCompletionRequest(messages=messages, tools=TOOLS)
    ids = encode_prompt(json_llm.tokenizer, chat_messages(req), json_llm.model.vocab_size, chat_tools(req))
    text = json_llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert "TOOLS:add:turn" in text
    assert 'CALL:add:{"a": 3, "b": true}' in text.replace("<unk>", " ")  # arguments reached the template as an object
    assert "tool<unk>>42ID:call_7</s>" in text  # "<|tool|>" is no special token of this tokenizer
    [r] = _post_all(json_llm, [{"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)  # the server rendered the same prompt


@pytest.mark.parametrize("patch, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": "add"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # no --tool-call-parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add",
                                                                                        "arguments": "{"}}]}]},
     "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages"),
])
def test_bad_tools_and_tool_choice_name_the_param(json_llm, patch, param):
    [r] = _post_all(json_llm, [{"messages": MSG, "max_tokens": 4, **patch}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err


# ------------------------------------------------------------ the Hermes parser
_CALLS = st.tuples(st.text("abcxyz_", min_size=1, max_size=6),
                   st.dictionaries(st.text("pqr", min_size=1, max_size=3),
                                   st.one_of(st.integers(-5, 99), st.text("ab <>/é", max_size=5), st.booleans()),
                                   max_size=3))
# text without "<" cannot form a tag; the tail may end in a partial tag or an unterminated call
_TEXT = st.lists(st.sampled_from(list("ab >/\n{}\"_") + ["tool_call", "/tool_call>"]), max_size=10).map("".join)
_TAIL = st.sampled_from(["", "<", "<tool", "<tool_call", '<tool_call>{"name": "f", "arguments": {}}', "<tool_call></tool"])
_BAD = st.sampled_from(["{", '{"name": 3}', '{"arguments": {}}', "[1]", '{"name": "f", "arguments": 5}', "nope", ""])


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(_TEXT, st.one_of(_CALLS, _BAD)), max_size=3), _TEXT, _TAIL, st.lists(st.integers(1, 9), max_size=8))
def test_hermes_parser_recovers_what_was_put_in(parts, tail, partial, cuts):
    text, content, calls = "", "", []
    for before, call in parts:
        if isinstance(call, tuple):
            body = json.dumps({"name": call[0], "arguments": call[1]}, ensure_ascii=False)
            text, content = text + before + f"<tool_call>{body}</tool_call>", content + before
            calls.append((call[0], json.dumps(call[1], ensure_ascii=False)))
        else:  # malformed: stays content, tags and all
            bad = before + f"<tool_call>{call}</tool_call>"
            text, content = text + bad, content + bad
    text, content = text + tail + partial, content + tail + partial
    assert parse_hermes(text) == (content, calls)
    # fed in arbitrary pieces, the parser finds the same
    p, events, at = HermesParser(), [], 0
    for cut in cuts:
        events += p.feed(text[at:at + cut])
        at += cut
    events += p.feed(text[at:]) + p.finish()
    assert "".join(e for e in events if isinstance(e, str)) == content
    assert [e for e in events if isinstance(e, tuple)] == calls


def test_hermes_unterminated_and_malformed_calls_stay_content():
    assert parse_hermes('hi <tool_call>{"name": "f", "arguments": {}}') == ('hi <tool_call>{"name": "f", "arguments": {}}', [])
    assert parse_hermes("<tool_call>not json</tool_call> x") == ("<tool_call>not json</tool_call> x", [])
    assert parse_hermes('<tool_call>\n{"name": "f", "arguments": {"k": 1}}\n</tool_call>\n') == ("\n", [("f", '{"k": 1}')])
    assert parse_hermes("<tool_ca") == ("<tool_ca", [])


def test_the_router_renders_tools_as_the_replica(json_llm):
    from hybridkv.router.router import ReplicaSpec, Router, RouterConfig

    router = Router([ReplicaSpec("http://r0:8000")], RouterConfig(policy="least-loaded", health_interval=60),
                    json_llm.tokenizer)
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    [r] = _post_all(json_llm, [body])
    ids = router.prompt_ids(body, chat=True)
    assert ids is not None and len(ids) == r.json()["usage"]["prompt_tokens"]
    assert len(router.prompt_ids({"messages": MSG}, chat=True)) < len(ids)
