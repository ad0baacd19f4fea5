"""What a hostile client found, in-process on the tiny model: ``/kv_cache/peek``'s errors say
what is wrong in words (no Python exception text), it needs the API key like ``/v1`` (only
``/health`` and ``/metrics`` stay open), and a chat message's role is one of OpenAI's."""

from __future__ import annotations

import json
import shutil

from hybridkv.protocol.openai import CHAT_ROLES
from hybridkv.server import ServerConfig

from tests.support.tiny_server import engine_config, run_app

CHAT, PEEK = "/v1/chat/completions", "/kv_cache/peek"


def _error(r, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for leak in ("unpack", "expected 1", "Traceback", "Error:"):  # Python's words, not ours
        assert leak not in err["message"], err
    return err["message"]


def test_peek_refuses_in_words_and_names_the_param(tiny_llm):
    bodies = [{"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3], [4]]}, {"prompt": ""}, {"prompt": [1, 999]},
              {"prompt": 5}, {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": "x"}]

    async def body(client, front, app):
        return [await client.post(PEEK, json=b) for b in bodies]

    results, _ = run_app(tiny_llm, body)
    two, three, empty, out_of_vocab, number, wizard, not_a_list = results
    assert _error(two, 400, "prompt") == "give one prompt, got 2"
    assert _error(three, 400, "prompt") == "give one prompt, got 3"
    assert "give one prompt" not in _error(empty, 400, "prompt")  # its own reason, not a count
    assert "give one prompt" not in _error(out_of_vocab, 400, "prompt")
    _error(number, 400, "prompt")
    assert _error(wizard, 400, "messages").startswith("messages.0.role: ")
    _error(not_a_list, 400, "messages")


def test_peek_needs_the_api_key_health_and_metrics_do_not(tiny_llm):
    from hybridkv.server.metrics import ServerMetrics

    key = {"authorization": "Bearer k"}

    async def body(client, front, app):
        return {
            "peek": await client.post(PEEK, json={"prompt": "hi"}),
            "peek_bad_key": await client.post(PEEK, json={"prompt": "hi"}, headers={"authorization": "Bearer x"}),
            "peek_key": await client.post(PEEK, json={"prompt": "hi"}, headers=key),
            "unknown": await client.get("/somewhere"),
            "health": await client.get("/health"),
            "metrics": await client.get("/metrics"),
        }

    r, _ = run_app(tiny_llm, body, config=ServerConfig(model_name="tiny", api_key="k"),
                   metrics=ServerMetrics(tiny_llm.engine, "tiny"))
    for name in ("peek", "peek_bad_key", "unknown"):  # every route but the two probes' needs it
        assert r[name].status_code == 401 and r[name].json()["error"]["code"] == "invalid_api_key", name
    assert r["peek_key"].status_code == 200 and r["peek_key"].json()["prompt_tokens"] > 0
    assert r["health"].status_code == 200
    assert r["metrics"].status_code == 200 and "vllm:num_requests_running" in r["metrics"].text


def _chat(messages: list[dict]) -> dict:
    return {"messages": messages, "max_tokens": 3, "temperature": 0}


def test_a_role_outside_openais_is_a_400_naming_messages(tiny_llm):
    bad = ["wizard", "model", "System", "", "user "]

    async def body(client, front, app):
        refused = [await client.post(CHAT, json=_chat([{"role": "user", "content": "hi"},
                                                        {"role": role, "content": "x"}])) for role in bad]
        every = [{"role": role, "content": f"a {role} says"} for role in CHAT_ROLES]
        every.append({"role": "user", "content": "go"})
        return refused, await client.post(CHAT, json=_chat(every)), front.num_unfinished

    (refused, every, unfinished), blocks = run_app(tiny_llm, body)
    for r in refused:
        message = _error(r, 400, "messages")
        assert message.startswith("messages.1.role: ") and all(role in message for role in CHAT_ROLES), message
    assert every.status_code == 200, every.text  # tool and the deprecated function included
    assert unfinished == 0 and blocks[0] == blocks[1]


def test_a_developer_message_is_rendered_as_system(tiny_llm):
    """The tiny template writes each role out (``<|role|>``): a developer message's prompt is the
    system message's, token for token (OpenAI's meaning; templates do not know "developer")."""

    async def body(client, front, app):
        out = {}
        for role in ("system", "developer"):
            messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
            out[role] = ((await client.post(CHAT, json=_chat(messages))).json(),
                         (await client.post(PEEK, json={"messages": messages})).json())
        return out

    out, _ = run_app(tiny_llm, body)
    (system, system_peek), (developer, developer_peek) = out["system"], out["developer"]
    assert developer["usage"]["prompt_tokens"] == system["usage"]["prompt_tokens"] == system_peek["prompt_tokens"]
    assert developer["choices"][0]["message"] == system["choices"][0]["message"]  # greedy: the same prompt
    assert developer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the system one's blocks
    assert developer_peek == {"prompt_tokens": system_peek["prompt_tokens"],
                              "cached_tokens": developer_peek["cached_tokens"]}


def test_developer_and_tool_never_500_on_a_template_that_knows_three_roles(tiny_dir, tmp_path):
    """A template that refuses roles other than system / user / assistant (as Gemma's refuses
    non-alternating ones): developer works (rendered as system), tool is the template's 400."""
    from hybridkv.engine.llm import LLM

    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                            "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}<|assistant|>")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(model), engine_config(num_blocks=64))

    async def body(client, front, app):
        developer = await client.post(CHAT, json=_chat([{"role": "developer", "content": "be brief"},
                                                        {"role": "user", "content": "hi"}]))
        tool = await client.post(CHAT, json=_chat([{"role": "user", "content": "hi"},
                                                   {"role": "tool", "content": "42"}]))
        return developer, tool

    (developer, tool), _ = run_app(llm, body)
    assert developer.status_code == 200, developer.text
    assert "unknown role tool" in _error(tool, 400, "messages")
