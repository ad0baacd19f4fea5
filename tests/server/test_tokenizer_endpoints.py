"""vLLM's tokenizer routes in-process (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), as
lm-eval's remote tokenizer drives them; and the other client-compat items of the same change:
chat ``echo`` (vLLM's meaning), streamed ``text_offset`` equal to the non-streamed one, ``n: null``."""

from __future__ import annotations

import json
import random
import threading

from hybridkv.server import ServerConfig

from tests.support.tiny_server import run_app
from tests.support.tiny_tokenizer import CHARS, SPECIALS

CHAT = "/v1/chat/completions"
MSG = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]

#: the characters the tiny tokenizer has (its vocabulary is the first 128 ids), "▁" being a space
TEXT_CHARS = [c for c in CHARS[: 128 - len(SPECIALS)] if c != "▁"]


def _random_text(rng: random.Random) -> str:
    """Words of the tokenizer's characters (and its special tokens) joined by one or two spaces,
    not starting with a space (SentencePiece's "▁" prefix is not given back for that one)."""
    words = []
    for _ in range(rng.randint(1, 8)):
        if rng.random() < 0.1:
            words.append(rng.choice(["</s>", "<s>", "<|user|>"]))
        else:
            words.append("".join(rng.choice(TEXT_CHARS) for _ in range(rng.randint(1, 7))))
    text = words[0]
    for w in words[1:]:
        text += rng.choice([" ", " ", "  ", ""]) + w
    return text + rng.choice(["", " "])


def test_tokenize_text_and_chat_as_vllm_shapes_them(tiny_llm):
    tok = tiny_llm.tokenizer
    text = "hello world"
    tmpl = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]

    async def body(client, front, app):
        return (
            (await client.post("/tokenize", json={"prompt": text})).json(),
            (await client.post("/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False,
                                                  "return_token_strs": True})).json(),
            (await client.post("/tokenize", json={"prompt": ""})).json(),
            (await client.post("/tokenize", json={"messages": MSG})).json(),
            (await client.post("/tokenize", json={"messages": tmpl, "add_generation_prompt": False})).json(),
            (await client.post("/tokenize", json={"messages": MSG, "add_special_tokens": True})).json(),
            (await client.post(CHAT, json={"messages": MSG, "max_tokens": 1})).json(),
        )

    (plain, bare, empty, chat, no_gen, chat_bos, completion), _ = run_app(tiny_llm, body)
    assert plain == {"count": len(tok.encode(text)), "max_model_len": 256, "tokens": tok.encode(text),
                     "token_strs": None}
    assert plain["tokens"][0] == tok.bos_token_id and plain["tokens"][1:] == bare["tokens"]
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and bare["count"] == len(bare["tokens"])
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"]) and bare["token_strs"][1] == "h"
    assert empty["tokens"] == [tok.bos_token_id] and empty["count"] == 1
    # a chat's ids are the chat route's prompt: the same count as its usage
    assert chat["tokens"] == tiny_llm.encode(MSG)
    assert chat["count"] == completion["usage"]["prompt_tokens"]
    assert no_gen["tokens"] == tok.encode(tok.apply_chat_template(tmpl, add_generation_prompt=False),
                                          add_special_tokens=False)
    assert no_gen["tokens"] != tiny_llm.encode(tmpl)  # the generation prompt is left out
    assert chat_bos["tokens"] == [tok.bos_token_id, *chat["tokens"]]


def test_random_texts_round_trip_and_random_ids_decode_as_the_tokenizer(tiny_llm):
    """Seeded property: text -> /tokenize (no specials, as lm-eval asks) -> /detokenize is the
    text; random ids -> /detokenize is the LLM tokenizer's decode, special tokens kept."""
    rng = random.Random(1234)
    texts = [_random_text(rng) for _ in range(40)]
    id_lists = [[rng.randrange(128) for _ in range(rng.randint(0, 30))] for _ in range(40)]

    async def body(client, front, app):
        back, encoded = [], []
        for text in texts:
            ids = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
            encoded.append(ids)
            back.append((await client.post("/detokenize", json={"tokens": ids})).json()["prompt"])
        decoded = [(await client.post("/detokenize", json={"tokens": ids})).json()["prompt"] for ids in id_lists]
        return back, encoded, decoded

    (back, encoded, decoded), _ = run_app(tiny_llm, body)
    assert back == texts
    assert encoded == [tiny_llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert decoded == [tiny_llm.tokenizer.decode(ids, skip_special_tokens=False) for ids in id_lists]
    assert any("</s>" in d for d in decoded)  # special tokens are not skipped


def test_lm_eval_remote_tokenizer_flow(tiny_llm):
    """What lm-eval 0.4's RemoteTokenizer does: ``/tokenizer_info`` must have ``eos_token``,
    ``/tokenize`` of ``{"prompt": "test", "add_special_tokens": false}`` must give ``tokens``;
    its eos / bos ids are ``encode(text)[0]``; it renders chats with ``chat_template``."""
    tok = tiny_llm.tokenizer

    async def body(client, front, app):
        info = (await client.get("/tokenizer_info")).json()
        probe = (await client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})).json()
        eos = (await client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})).json()
        bos = (await client.post("/tokenize", json={"prompt": info["bos_token"], "add_special_tokens": False})).json()
        text = (await client.post("/detokenize", json={"tokens": probe["tokens"]})).json()
        return info, probe, eos, bos, text

    (info, probe, eos, bos, text), _ = run_app(tiny_llm, body)
    assert isinstance(info["eos_token"], str) and info["eos_token"] == "</s>"
    assert info["tokenizer_class"] == "HFTokenizer" and info["bos_token"] == "<s>" and info["unk_token"] == "<unk>"
    assert info["model_max_length"] == info["max_model_len"] == 256 and info["vocab_size"] == 128
    assert info["chat_template"] == tok.chat_template
    assert isinstance(probe["tokens"], list) and probe["tokens"]
    assert eos["tokens"][0] == tok.eos_token_ids[0] and eos["tokens"][0] in tiny_llm.eos_token_ids
    assert bos["tokens"][0] == tok.bos_token_id
    assert text == {"prompt": "test"}


def test_a_random_bad_input_table_is_400_naming_the_field(tiny_llm):
    """Seeded: one field of a valid body set to a random wrong value -> 400 naming that field;
    a random id list with one bad id anywhere -> 400 naming ``tokens``. Nothing else changes."""
    rng = random.Random(99)
    wrong = {
        "prompt": [5, None, ["a"], {"a": 1}, True, 1.5],
        "add_special_tokens": ["yes", 1, None, 0.0, []],
        "return_token_strs": ["no", 2, [], {}],
        "model": [3, ["tiny"], False],
        "messages": ["hi", [], [{"role": "wizard", "content": "x"}], [{"content": "no role"}], None, 7,
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                     [{"role": "user", "content": "a\ud800"}]],
        "add_generation_prompt": ["true", 1, None],
        "continue_final_message": [True, "x"],
        "chat_template": ["{{ messages }}", 5],
        "chat_template_kwargs": [{"x": 1}, "x"],
        "tools": [[{"type": "function"}], 3],
    }
    text_fields = ["prompt", "add_special_tokens", "return_token_strs", "model"]
    chat_fields = ["messages", "add_special_tokens", "return_token_strs", "add_generation_prompt",
                   "continue_final_message", "chat_template", "chat_template_kwargs", "tools"]
    cases = []
    for _ in range(40):
        chat = rng.random() < 0.5
        field = rng.choice(chat_fields if chat else text_fields)
        base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        cases.append(("/tokenize", {**base, field: rng.choice(wrong[field])}, field))
    bad_ids = [-1, 128, 10**30, True, 1.5, "1", None, [1]]
    for _ in range(25):
        ids = [rng.randrange(128) for _ in range(rng.randint(0, 10))]
        ids.insert(rng.randint(0, len(ids)), rng.choice(bad_ids))
        cases.append(("/detokenize", {"tokens": ids}, "tokens"))
    cases.append(("/detokenize", {"tokens": "abc"}, "tokens"))
    cases.append(("/detokenize", {}, "tokens"))

    async def body(client, front, app):
        out = [await client.post(route, content=json.dumps(payload), headers={"content-type": "application/json"})
               for route, payload, _ in cases]
        return out, await client.post("/tokenize", json={"prompt": "still"})

    (results, ok), _ = run_app(tiny_llm, body)
    for (route, payload, field), r in zip(cases, results):
        assert r.status_code == 400, (route, payload, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error", (payload, err)
        assert "Traceback" not in err["message"]
    assert ok.status_code == 200


def test_a_model_without_a_tokenizer(tiny_dir, tmp_path):
    """Token ids only: /tokenize and /detokenize are a 400 that says so; /tokenizer_info a 404
    (lm-eval's check then falls back to its own tokenizer); generation by ids still works."""
    import shutil

    from hybridkv.engine.llm import LLM

    from tests.support.tiny_server import engine_config

    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    llm = LLM(str(model), engine_config(num_blocks=64))
    assert llm.tokenizer is None

    async def body(client, front, app):
        return (await client.post("/tokenize", json={"prompt": "hi"}),
                await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}),
                await client.post("/detokenize", json={"tokens": [1, 2]}),
                await client.get("/tokenizer_info"),
                await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}))

    (text, chat, detok, info, ids), _ = run_app(llm, body)
    for r, param in ((text, "prompt"), (chat, "messages"), (detok, "tokens")):
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert "needs a tokenizer; this model has none" in r.json()["error"]["message"]
    assert info.status_code == 404 and info.json()["error"]["message"] == "this model has no tokenizer"
    assert ids.status_code == 200


def test_the_tokenizer_routes_need_the_api_key_and_tokenize_off_the_loop(tiny_llm, monkeypatch):
    threads: list[str] = []
    real = tiny_llm.tokenizer

    class Watched:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return real.encode(*args, **kwargs)

        def decode(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return real.decode(*args, **kwargs)

    monkeypatch.setattr(tiny_llm, "tokenizer", Watched())
    key = {"authorization": "Bearer k"}

    async def body(client, front, app):
        return ([await client.post("/tokenize", json={"prompt": "x"}),
                 await client.post("/detokenize", json={"tokens": [1]}),
                 await client.get("/tokenizer_info")],
                [await client.post("/tokenize", json={"prompt": "x"}, headers=key),
                 await client.post("/detokenize", json={"tokens": [14]}, headers=key),
                 await client.get("/tokenizer_info", headers=key)])

    (refused, allowed), _ = run_app(tiny_llm, body, config=ServerConfig(model_name="tiny", api_key="k"))
    assert [r.status_code for r in refused] == [401, 401, 401]
    assert all(r.json()["error"]["code"] == "invalid_api_key" for r in refused)
    assert [r.status_code for r in allowed] == [200, 200, 200]
    assert allowed[1].json() == {"prompt": "h"}
    assert len(threads) == 2 and all(t.startswith("hybridkv-parse") for t in threads), threads


# ---------------------------------------------------------------- chat echo, text_offset, n: null
def _sse(text: str) -> list[dict]:
    return [json.loads(b[len("data: "):]) for b in text.split("\n\n") if b and b != "data: [DONE]"]


def test_chat_echo_starts_the_reply_with_the_last_assistant_message(tiny_llm):
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, ok"}]
    parts = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Sure, "}, {"type": "text", "text": "ok"}]}]
    base = {"max_tokens": 6, "temperature": 0}

    async def body(client, front, app):
        plain = (await client.post(CHAT, json={"messages": prefill, **base})).json()
        echoed = (await client.post(CHAT, json={"messages": prefill, "echo": True, **base})).json()
        from_parts = (await client.post(CHAT, json={"messages": parts, "echo": True, **base})).json()
        stream = (await client.post(CHAT, json={"messages": prefill, "echo": True, "stream": True, **base})).text
        user_last = (await client.post(CHAT, json={"messages": MSG, "echo": True, **base})).json()
        user_plain = (await client.post(CHAT, json={"messages": MSG, **base})).json()
        return plain, echoed, from_parts, stream, user_last, user_plain

    (plain, echoed, from_parts, stream, user_last, user_plain), _ = run_app(tiny_llm, body)
    generated = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Sure, ok" + generated
    assert from_parts["choices"][0]["message"]["content"] == "Sure, ok" + generated
    for key in ("prompt_tokens", "completion_tokens"):  # the echo is not a generated token
        assert echoed["usage"][key] == plain["usage"][key]
    chunks = _sse(stream)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["choices"][0]["delta"]["content"].startswith("Sure, ok")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Sure, ok" + generated
    # the last message is the user's, not the reply's role: nothing is echoed
    assert user_last["choices"][0]["message"]["content"] == user_plain["choices"][0]["message"]["content"]


def test_streamed_text_offset_goes_on_across_chunks_as_the_full_response(tiny_llm):
    prompts = ["hello world", "the quick brown fox"]
    req = {"prompt": prompts, "max_tokens": 12, "temperature": 0, "logprobs": 2}

    async def body(client, front, app):
        full = (await client.post("/v1/completions", json=req)).json()
        stream = (await client.post("/v1/completions", json={**req, "stream": True})).text
        return full, stream

    (full, stream), _ = run_app(tiny_llm, body)
    streamed: dict[int, dict[str, list]] = {}
    for event in _sse(stream):
        [c] = event["choices"]
        if c["logprobs"] is not None:
            got = streamed.setdefault(c["index"], {"tokens": [], "text_offset": []})
            got["tokens"] += c["logprobs"]["tokens"]
            got["text_offset"] += c["logprobs"]["text_offset"]
    for choice in full["choices"]:
        lp = choice["logprobs"]
        assert streamed[choice["index"]] == {"tokens": lp["tokens"], "text_offset": lp["text_offset"]}
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and len(offsets) == 12
        assert all(b == a + len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"]))
        assert offsets[-1] > 0  # not restarted per chunk


def test_n_null_is_one(tiny_llm):
    async def body(client, front, app):
        return (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": None}),
                await client.post(CHAT, json={"messages": MSG, "max_tokens": 2, "n": None}),
                await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2}))  # tests/server/test_n.py

    (completion, chat, two), _ = run_app(tiny_llm, body)
    assert completion.status_code == 200 and len(completion.json()["choices"]) == 1
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 1
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
