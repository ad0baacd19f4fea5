"""Every bad request is a 4xx in OpenAI's error shape, changes nothing, and the server keeps serving."""

from __future__ import annotations

import json

from hybridkv.server import ServerConfig

from tests.support.tiny_server import run_app

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

#: (route, raw body or JSON object, status, param, code)
CASES = [
    (C, "{bad json", 400, None, None),
    (C, "", 400, None, None),
    (C, "[]", 400, None, None),
    (C, "null", 400, None, None),
    (C, {}, 400, "prompt", None),
    (C, {"prompt": 5}, 400, "prompt", None),
    (C, {"prompt": ""}, 400, "prompt", None),
    (C, {"prompt": []}, 400, "prompt", None),
    (C, {"prompt": [[]]}, 400, "prompt", None),
    (C, {"prompt": [1, 2, 128]}, 400, "prompt", None),
    (C, {"prompt": [1, -2]}, 400, "prompt", None),
    (C, {"prompt": [1, True]}, 400, "prompt", None),
    (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": 10**30}, 400, None, "context_length_exceeded"),
    (C, {"prompt": "x", "max_tokens": 255}, 400, None, "context_length_exceeded"),
    (C, {"prompt": "a" * 300}, 400, None, "context_length_exceeded"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    (C, {"prompt": "x", "temperature": 10**400}, 400, "temperature", None),
    (C, {"prompt": "x", "top_p": 10**400}, 400, "top_p", None),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop", None),
    (C, {"prompt": "x", "stop": 3}, 400, "stop", None),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    (C, {"prompt": "x", "n": 0}, 400, "n", None),
    (C, {"prompt": ["x"] * 9, "n": 8}, 400, "n", None),  # 72 sequences > max_prompts_per_request
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of", None),
    (C, {"prompt": "x", "echo": "yes"}, 400, "echo", None),
    (C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    (C, {"prompt": "x", "prompt_logprobs": "3"}, 400, "prompt_logprobs", None),
    (C, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs", None),
    (CHAT, {"messages": MSG, "prompt_logprobs": -1}, 400, "prompt_logprobs", None),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    (C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", None),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (C, {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias", None),
    (C, {"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias", None),
    (C, {"prompt": "x", "logit_bias": {"one": 5}}, 400, "logit_bias", None),
    (CHAT, {"messages": MSG, "max_tokens": 5, "min_tokens": 6}, 400, "min_tokens", None),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (C, {"prompt": ["x"] * 65}, 400, "prompt", None),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": "hi"}, 400, "messages", None),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),  # OpenAI's roles only
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", None),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", None),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    (CHAT, {"messages": MSG, "max_completion_tokens": 1000}, 400, None, "context_length_exceeded"),
    (CHAT, {"messages": MSG, "n": -1}, 400, "n", None),
    (CHAT, {"messages": MSG, "n": 2, "best_of": 3}, 400, "best_of", None),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", None),
    (CHAT, {"messages": MSG, "response_format": {"type": "grammar"}}, 400, "response_format", None),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, 400, "response_format", None),
    (C, {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs", None),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs", None),
    (CHAT, {"messages": MSG, "model": "other"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": [{"role": "user", "content": "a" * 300}]}, 400, None, "context_length_exceeded"),
    # lone surrogates (JSON "\ud800" escapes): not valid Unicode, a 400 naming the field
    (C, {"prompt": "a\ud800b"}, 400, "prompt", None),
    (C, {"prompt": ["ok", "\udfff"]}, 400, "prompt", None),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "us\ud800er", "content": "hi"}]}, 400, "messages", None),
    # vLLM's tokenizer routes (more in test_tokenizer_endpoints.py), chat echo's and n's types
    ("/tokenize", {}, 400, "prompt", None),
    ("/tokenize", "{bad json", 400, None, None),
    ("/tokenize", "", 400, None, None),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "prompt", None),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens", None),
    ("/tokenize", {"prompt": "a\ud800"}, 400, "prompt", None),
    ("/tokenize", {"prompt": "a" * 7000}, 400, "prompt", "context_length_exceeded"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a" * 7000}]}, 400, "messages", "context_length_exceeded"),
    ("/tokenize", {"messages": MSG, "continue_final_message": True}, 400, "continue_final_message", None),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/detokenize", "[]", 400, None, None),
    ("/detokenize", {"tokens": [1, 128]}, 400, "tokens", None),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", None),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": MSG, "echo": "yes"}, 400, "echo", None),
    (C, {"prompt": "x", "n": "1"}, 400, "n", None),
]


def _check_error(r, status, param, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert err["code"] == code, err


def test_bad_requests_are_4xx_and_change_nothing(tiny_llm):
    async def body(client, front, app):
        results = []
        for route, payload, *_ in CASES:
            content = payload if isinstance(payload, str) else json.dumps(payload)
            results.append(await client.post(route, content=content, headers={"content-type": "application/json"}))
            assert front.num_unfinished == 0
        ok = await client.post(C, json={"prompt": "still serving", "max_tokens": 4})
        return results, ok

    (results, ok), blocks = run_app(tiny_llm, body)
    for (route, payload, status, param, code), r in zip(CASES, results):
        _check_error(r, status, param, code)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert blocks[0] == blocks[1]
    assert not tiny_llm.engine.has_unfinished_requests()


def test_a_template_that_raises_is_a_400(tiny_dir, tmp_path):
    import shutil

    from hybridkv.engine.llm import LLM

    from tests.support.tiny_server import engine_config

    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(model), engine_config(num_blocks=64))

    async def body(client, front, app):
        bad = await client.post(CHAT, json={"messages": MSG})
        bad_tokenize = await client.post("/tokenize", json={"messages": MSG})
        good = await client.post(C, json={"prompt": "hi", "max_tokens": 2})
        return bad, bad_tokenize, good

    (bad, bad_tokenize, good), _ = run_app(llm, body)
    for r in (bad, bad_tokenize):  # the same template path on /tokenize
        _check_error(r, 400, "messages", None)
        assert "roles must alternate" in r.json()["error"]["message"]
    assert good.status_code == 200


def test_unknown_routes_methods_and_auth(tiny_llm):
    async def body(client, front, app):
        return (
            await client.get("/v1/nothing", headers={"authorization": "Bearer k"}),
            await client.get(C, headers={"authorization": "Bearer k"}),
            await client.post(C, json={"prompt": "x"}),
            await client.post(C, json={"prompt": "x", "max_tokens": 1}, headers={"authorization": "Bearer k"}),
            await client.get("/health"),
        )

    (missing, method, noauth, auth, health), _ = run_app(
        tiny_llm, body, config=ServerConfig(model_name="tiny", api_key="k"))
    assert missing.status_code == 404 and "error" in missing.json()
    assert method.status_code == 405 and "error" in method.json()
    assert noauth.status_code == 401 and noauth.json()["error"]["code"] == "invalid_api_key"
    assert auth.status_code == 200
    assert health.status_code == 200  # no key needed outside /v1


def test_a_full_queue_is_503_with_retry_after(tiny_llm):
    import asyncio

    async def body(client, front, app):
        # max_waiting 2: three prompts in one request can never be admitted at once
        over = await client.post(C, json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        ok = await client.post(C, json={"prompt": ["a", "b"], "max_tokens": 2})
        front.close_admission()
        closed = await client.post(C, json={"prompt": "a", "max_tokens": 2})
        health = await client.get("/health")
        await asyncio.sleep(0)
        return over, ok, closed, health

    (over, ok, closed, health), blocks = run_app(tiny_llm, body, max_waiting=2)
    for r in (over, closed):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_overloaded"
    assert ok.status_code == 200
    assert health.status_code == 503
    assert blocks[0] == blocks[1]


def test_every_library_error_has_a_response():
    """Each class of hybridkv.errors maps to a status: 4xx/503 for bad input and overload,
    500 (no detail on the wire) only for invariant violations and the bare base class."""
    import hybridkv.errors as E
    from hybridkv.protocol.errors import to_response

    for cls_name in E.__all__:
        cls = getattr(E, cls_name)
        exc = cls("some detail")
        r = to_response(exc)
        assert set(r.body["error"]) == {"message", "type", "param", "code"}
        if cls in (E.HybridKVError, E.InvariantViolation, E.EngineFailedError):
            assert r.status == 500 and "some detail" not in r.body["error"]["message"]
        else:
            assert 400 <= r.status < 500 or r.status == 503, cls_name
            assert r.body["error"]["message"] == "some detail"
    assert to_response(RuntimeError("secret")).status == 500
    assert "secret" not in json.dumps(to_response(RuntimeError("secret")).body)
