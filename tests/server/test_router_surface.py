"""What routers and gateways call on ``serve`` (in-process, the tiny model): vLLM's render routes,
``/get_load``, ``/get_server_info``, ``/get_model_info``, ``/kv_event_sources``, ``/version``,
``/v1/models/{id}``, CORS; ``null`` optional fields; legacy fields honoured or refused.

The oracle of render is generation itself: the ids it renders are the ids generation runs
(``usage.prompt_tokens``, ``/tokenize``), and a body generation refuses is refused by render
with the same status and ``param``, with nothing queued.
"""

from __future__ import annotations

import json
import random

import pytest

from hybridkv.server import ServerConfig

from tests.support.tiny_server import run_app

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]

#: bodies generation refuses (4xx): render must refuse each the same way
BAD_BODIES = [
    (C, {"prompt": "abc", "max_tokens": 0}),
    (C, {"prompt": "abc", "model": "other"}),
    (C, {"prompt": "abc", "logprobs": 21}),
    (C, {"prompt": "abc", "n": 100}),
    (C, {"prompt": "a" * 5000}),
    (C, {"prompt": [1, 2, 10**9]}),
    (C, {"prompt": "abc", "temperature": -1}),
    (C, {"prompt": "abc", "suffix": "x"}),
    (C, {"prompt": "abc", "max_tokens": "4"}),
    (C, {"prompt": None}),
    (CHAT, {"messages": MSG, "top_logprobs": 3}),
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}),
    (CHAT, {"messages": MSG, "function_call": "auto"}),
    (CHAT, {"messages": MSG, "continue_final_message": True}),
    (CHAT, {"messages": MSG, "guided_choice": ["a"], "response_format": {"type": "json_object"}}),
    (CHAT, {"messages": MSG, "guided_decoding_backend": "xgrammar", "guided_choice": ["a"]}),
    (CHAT, {"messages": MSG, "guided_whitespace_pattern": " "}),
    (CHAT, {"messages": [{"role": "user", "content": None}], "messages_extra": 1, "max_tokens": -3}),
    (CHAT, {"messages": None}),
]


def test_render_gives_the_ids_and_params_generation_runs(tiny_llm):
    prompts = ["hello world", "the quick brown fox"]

    async def body(client, front, app):
        rendered = (await client.post(C + "/render", json={"prompt": prompts, "max_tokens": 5, "seed": 7})).json()
        ran = (await client.post(C, json={"prompt": prompts, "max_tokens": 5, "seed": 7})).json()
        tokenized = [(await client.post("/tokenize", json={"prompt": p})).json()["tokens"] for p in prompts]
        chat_r = (await client.post(CHAT + "/render", json={"messages": MSG, "logprobs": True, "top_logprobs": 2})).json()
        chat_ran = (await client.post(CHAT, json={"messages": MSG, "max_tokens": 3})).json()
        chat_tok = (await client.post("/tokenize", json={"messages": MSG})).json()["tokens"]
        ids_r = (await client.post(C + "/render", json={"prompt": [5, 6, 7], "stream": True,
                                                         "stream_options": {"include_usage": True}})).json()
        return rendered, ran, tokenized, chat_r, chat_ran, chat_tok, ids_r, front.num_unfinished

    (rendered, ran, tokenized, chat_r, chat_ran, chat_tok, ids_r, unfinished), blocks = run_app(tiny_llm, body)
    assert isinstance(rendered, list) and len(rendered) == 2
    assert [r["token_ids"] for r in rendered] == tokenized
    assert sum(len(r["token_ids"]) for r in rendered) == ran["usage"]["prompt_tokens"]
    for r in rendered:
        assert r["features"] is None and r["model"] is None and r["stream"] is False and r["priority"] == 0
        sp = r["sampling_params"]
        assert (sp["max_tokens"], sp["seed"], sp["n"], sp["temperature"]) == (5, 7, 1, 1.0)
        assert set(tiny_llm.eos_token_ids) <= set(sp["stop_token_ids"])
    assert len({r["request_id"] for r in rendered}) == 2
    assert isinstance(chat_r, dict) and chat_r["token_ids"] == chat_tok
    assert len(chat_tok) == chat_ran["usage"]["prompt_tokens"]
    assert chat_r["sampling_params"]["logprobs"] == 2
    assert chat_r["sampling_params"]["max_tokens"] == 256 - len(chat_tok)  # chat: the rest of the context
    assert ids_r[0]["token_ids"] == [5, 6, 7] and ids_r[0]["sampling_params"]["max_tokens"] == 16
    assert ids_r[0]["stream"] is True and ids_r[0]["stream_options"] == {"include_usage": True}
    assert unfinished == 0 and blocks[0] == blocks[1]


def test_render_refuses_what_generation_refuses(tiny_llm):
    async def body(client, front, app):
        out = []
        for path, req in BAD_BODIES:
            gen = await client.post(path, json=req)
            ren = await client.post(path + "/render", json=req)
            out.append((path, req, gen.status_code, gen.json(), ren.status_code, ren.json()))
        return out, front.num_unfinished

    (out, unfinished), blocks = run_app(tiny_llm, body)
    for path, req, gs, gj, rs, rj in out:
        assert 400 <= gs < 500, (path, req, gj)
        assert (rs, rj["error"]["param"], rj["error"]["code"]) == (gs, gj["error"]["param"], gj["error"]["code"]), req
    assert unfinished == 0 and blocks[0] == blocks[1]


def test_legacy_fields_name_themselves(tiny_llm):
    async def body(client, front, app):
        return {k: (await client.post(CHAT, json={"messages": MSG, k: v})).json()["error"]["param"]
                for k, v in [("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
                             ("continue_final_message", True), ("guided_decoding_backend", "outlines")]}

    params, _ = run_app(tiny_llm, body)
    assert params == {k: k for k in params}


@pytest.mark.parametrize("legacy, modern", [
    ({"guided_choice": ["yes", "no", "maybe"]}, {"choice": ["yes", "no", "maybe"]}),
    ({"guided_regex": "[a-c]{2,6}x"}, {"regex": "[a-c]{2,6}x"}),
])
def test_guided_fields_mean_structured_outputs(tiny_llm, legacy, modern):
    pytest.importorskip("llguidance")

    async def body(client, front, app):
        req = {"prompt": "the quick brown fox", "max_tokens": 20, "temperature": 0}
        old = (await client.post(C, json={**req, **legacy})).json()
        new = (await client.post(C, json={**req, "structured_outputs": modern})).json()
        rendered = (await client.post(C + "/render", json={**req, **legacy})).json()
        return old, new, rendered

    (old, new, rendered), _ = run_app(tiny_llm, body)
    assert old["choices"][0]["text"] == new["choices"][0]["text"]
    assert rendered[0]["sampling_params"]["structured_outputs"] == modern


def test_null_optional_fields_are_their_defaults(tiny_llm):
    rng = random.Random(5)
    optional = {C: ["stream", "echo", "logprobs", "n", "temperature", "top_p", "seed", "stop", "user", "suffix",
                    "stream_options", "best_of", "presence_penalty", "logit_bias", "max_tokens", "guided_json"],
                CHAT: ["stream", "logprobs", "top_logprobs", "n", "echo", "tools", "tool_choice", "functions",
                       "continue_final_message", "max_completion_tokens", "add_generation_prompt", "response_format"]}
    cases = [(path, rng.sample(names, rng.randint(1, len(names)))) for path, names in optional.items() for _ in range(4)]

    async def body(client, front, app):
        out = []
        for path, nulls in cases:
            base = {"prompt": "hello world"} if path == C else {"messages": MSG}
            base.update(max_tokens=4, temperature=0) if "max_tokens" not in nulls else base.update(temperature=0)
            with_nulls = {**base, **dict.fromkeys(nulls)}
            out.append(((await client.post(path, json=with_nulls)).json(), (await client.post(path, json=base)).json()))
        bad = (await client.post(C, json={"prompt": None})).json()
        return out, bad

    (out, bad), blocks = run_app(tiny_llm, body)
    for (nulled, plain), case in zip(out, cases):
        assert "error" not in nulled, (case, nulled)
        assert [c.get("text", c.get("message")) for c in nulled["choices"]] == [
            c.get("text", c.get("message")) for c in plain["choices"]], case
    assert bad["error"]["param"] == "prompt"  # a required field's null is a 400 naming it
    assert blocks[0] == blocks[1]


def test_router_info_routes(tiny_llm):
    async def body(client, front, app):
        r = {p: await client.get(p) for p in ("/version", "/get_server_info", "/get_model_info", "/kv_event_sources",
                                               "/v1/models/tiny", "/v1/models/other", "/get_load")}
        from hybridkv.sampling_params import SamplingParams

        # two requests in flight (httpx's ASGI transport buffers whole responses: submitted directly)
        sub = await front.submit([[5, 6, 7]] * 2, [SamplingParams(max_tokens=200, ignore_eos=True)] * 2)
        busy = (await client.get("/get_load")).json()
        sub.close()
        for _ in range(200):
            if front.num_unfinished == 0:
                break
            await __import__("asyncio").sleep(0.02)
        idle = (await client.get("/get_load")).json()
        return r, busy, idle

    (r, busy, idle), _ = run_app(tiny_llm, body)
    assert r["/version"].json()["version"]
    info = r["/get_server_info"].json()
    assert info["model_id"] == "tiny" and info["kv_block_size"] == 4 and info["max_model_len"] == 256
    assert {g["kind"] for g in info["kv_cache_groups"]} == {"full_attention", "sliding_window"}
    assert r["/get_model_info"].json()["is_generation"] is True
    assert r["/kv_event_sources"].status_code == 404  # events off
    assert r["/v1/models/tiny"].json()["id"] == "tiny"
    assert r["/v1/models/other"].status_code == 404 and r["/v1/models/other"].json()["error"]["code"] == "model_not_found"
    assert r["/get_load"].json() == {"load": 0} and busy == {"load": 2} and idle == {"load": 0}


@pytest.mark.parametrize("origins, origin, allowed", [
    (("*",), "https://a.example", "*"),
    (("https://a.example",), "https://a.example", "https://a.example"),
    (("https://a.example",), "https://b.example", None),
    ((), "https://a.example", None),
])
def test_cors_preflight_comes_before_the_key(tiny_llm, origins, origin, allowed):
    config = ServerConfig(model_name="tiny", api_key="k", allowed_origins=origins)

    async def body(client, front, app):
        pre = await client.options(CHAT, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                  "Access-Control-Request-Headers": "authorization, content-type"})
        keyed = await client.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer k"})
        open_ = [(await client.get(p)).status_code for p in ("/get_load", "/version", "/health")]
        closed = [(await client.get(p)).status_code for p in ("/get_server_info", "/kv_event_sources")]
        return pre, keyed, open_, closed

    (pre, keyed, open_, closed), _ = run_app(tiny_llm, body, config=config)
    assert pre.headers.get("access-control-allow-origin") == allowed
    assert (pre.status_code == 200) == (allowed is not None)
    assert keyed.status_code == 200 and keyed.headers.get("access-control-allow-origin") == allowed
    assert open_ == [200, 200, 200] and closed == [401, 401]


def test_build_app_wires_what_serve_wires(tiny_dir, tiny_llm):
    from hybridkv.errors import InvalidConfigError
    from hybridkv.server import build_app

    from tests.support.tiny_server import engine_config

    with pytest.raises(InvalidConfigError):
        build_app(tiny_llm, engine=engine_config())  # a loaded LLM has its own
    with pytest.raises(InvalidConfigError):
        build_app(tiny_llm, server=ServerConfig(kv_events="tcp://127.0.0.1:0"))  # built without events
    app = build_app(str(tiny_dir), server=ServerConfig(
        model_name="tiny", kv_events="tcp://127.0.0.1:0", kv_events_replay="tcp://127.0.0.1:0", kv_events_topic="kv@p@m"))
    pub = app.state.front.kv_publisher
    try:
        config = app.state.front.engine.config
        assert config.enable_kv_events and config.queued_prefix == "refresh"  # serve's defaults
        assert app.state.metrics is not None and app.state.front.metrics is app.state.metrics
        sources = app.state.info.kv_event_sources()
        assert sources == {"0": {"publisher": "zmq", "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                 "topic": "kv@p@m", "encoding": "msgpack", "schema_version": 1,
                                 "enable_kv_cache_events": True, "block_hash_form": "int"}}
        assert json.dumps(sources)
    finally:
        pub.close()


def test_prompts_past_the_context_are_refused_before_they_are_read(tiny_llm):
    """``/kv_cache/peek`` and generation refuse a prompt with no room for an output token in
    ``max_model_len`` (256 here) alike: token ids by their count, before the body is validated
    (10,000 of them), or while it arrives when no request could hold that many values (1.5M: 413,
    the rest of the body unread), text by its tokens (a text too long for any tokenization by
    its length)."""
    import time

    chat_long = [{"role": "user", "content": "ab " * 200}]  # ~600 tokens with the tiny character vocabulary

    async def body(client, front, app):
        out = {}
        for name, req in [("ids", {"prompt": [5] * 300}), ("ids at the limit", {"prompt": [5] * 256}),
                          ("many ids", {"prompt": [5] * 10_000}), ("huge ids", {"prompt": [5] * 1_500_000}),
                          ("nested ids", {"prompt": [[5] * 9000]}), ("text", {"prompt": "abc " * 100}),
                          ("chat", {"messages": chat_long})]:
            t0 = time.perf_counter()
            peek = await client.post("/kv_cache/peek", json=req)
            gen = await client.post(C if "prompt" in req else CHAT, json={**req, "max_tokens": 1})
            out[name] = (peek.status_code, peek.json(), gen.status_code, gen.json(), time.perf_counter() - t0)
        ok = (await client.post("/kv_cache/peek", json={"prompt": [5] * 255})).json()
        return out, ok, front.num_unfinished

    (out, ok, unfinished), blocks = run_app(tiny_llm, body)
    huge = out.pop("huge ids")
    assert huge[0] == huge[2] == 413 and huge[1] == huge[3] and huge[1]["error"]["code"] == "request_too_large"
    for name, (ps, pj, gs, gj, _) in out.items():
        assert ps == gs == 400, (name, pj, gj)
        assert pj["error"]["code"] == gj["error"]["code"] == "context_length_exceeded", name
    assert ok == {"prompt_tokens": 255, "cached_tokens": 0}
    assert unfinished == 0 and blocks[0] == blocks[1]
