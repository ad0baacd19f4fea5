"""Prompt logprobs on the wire: completions ``echo`` with ``logprobs`` (OpenAI's legacy shape, what
lm-eval's loglikelihood tasks send), streamed and not, and vLLM's ``prompt_logprobs`` extra on
completions and chat; every value equal to the offline engine's scoring of the same prompt."""

from __future__ import annotations

import json
import random

from hybridkv.scheduler.interface import SamplingParams

from tests.support.tiny_server import run_app

C, CHAT = "/v1/completions", "/v1/chat/completions"


def _offline(tiny_llm, prompt: list[int], k: int):
    return tiny_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=k))[0]


def _events(text: str) -> list[dict]:
    return [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]


def test_echo_with_logprobs_is_the_prompt_scored_then_the_generation(tiny_llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 120) for _ in range(rng.randint(2, 30))] for _ in range(3)]
    want = [_offline(tiny_llm, p, 2) for p in prompts]
    body = {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True, "seed": 1234}

    async def run(client, front, app):
        whole = (await client.post(C, json=body)).json()
        streamed = (await client.post(C, json={**body, "prompt": prompts[0], "stream": True})).text
        return whole, streamed

    (whole, streamed), (free, usable) = run_app(tiny_llm, run)
    assert free == usable
    for choice, prompt, out in zip(sorted(whole["choices"], key=lambda c: c["index"]), prompts, want):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(prompt)):
            s = out.prompt_logprobs[p]
            assert lp["token_logprobs"][p] == s.logprob
            assert list(lp["top_logprobs"][p].values()) == [v for _, v in s.top]
        assert choice["text"].startswith(tiny_llm.tokenizer.decode(prompt, skip_special_tokens=False))
        # lm-eval's parse_logprobs: the continuation's sum and whether each token was the argmax
        ctxlen = 1
        cont = lp["token_logprobs"][ctxlen:-1]
        greedy = all(t == max(top.values()) for t, top in zip(cont, lp["top_logprobs"][ctxlen:-1]))
        assert sum(cont) == sum(s.logprob for s in out.prompt_logprobs[1:])
        assert greedy == all(s.rank == 1 for s in out.prompt_logprobs[1:])
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # streamed: the same tokens, values and offsets as the first choice of the whole response
    chunks = [e["choices"][0] for e in _events(streamed)]
    first = next(c for c in sorted(whole["choices"], key=lambda c: c["index"]) if c["index"] == 0)
    joined = {key: sum((c["logprobs"][key] for c in chunks if c["logprobs"]), []) for key in
              ("tokens", "token_logprobs", "text_offset")}
    assert joined == {key: first["logprobs"][key] for key in joined}
    assert "".join(c["text"] for c in chunks) == first["text"]


def test_echo_without_logprobs_and_text_prompts(tiny_llm):
    async def run(client, front, app):
        text = (await client.post(C, json={"prompt": "hello world", "max_tokens": 3, "echo": True})).json()
        plain = (await client.post(C, json={"prompt": "hello world", "max_tokens": 3, "temperature": 0})).json()
        echoed = (await client.post(C, json={"prompt": "hello world", "max_tokens": 3, "temperature": 0,
                                             "echo": True})).json()
        return text, plain, echoed

    (text, plain, echoed), _ = run_app(tiny_llm, run)
    assert text["choices"][0]["text"].startswith("hello world") and text["choices"][0]["logprobs"] is None
    assert echoed["choices"][0]["text"] == "hello world" + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"] | {"prompt_tokens_details": echoed["usage"]["prompt_tokens_details"]}


def test_vllms_prompt_logprobs_on_completions_and_chat(tiny_llm):
    prompt = list(range(5, 25))
    want = _offline(tiny_llm, prompt, 3)
    messages = [{"role": "user", "content": "score me"}]
    chat_ids = tiny_llm.encode(messages)
    chat_want = _offline(tiny_llm, chat_ids, 0)

    async def run(client, front, app):
        comp = (await client.post(C, json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3})).json()
        chat = (await client.post(CHAT, json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})).json()
        stream = (await client.post(CHAT, json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0,
                                                "stream": True})).text
        return comp, chat, stream

    (comp, chat, stream), _ = run_app(tiny_llm, run)
    scores = comp["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    for p in range(1, len(prompt)):
        s = want.prompt_logprobs[p]
        entry = scores[p]
        assert entry[str(prompt[p])]["logprob"] == s.logprob and entry[str(prompt[p])]["rank"] == s.rank
        assert len(entry) == 3 + (s.rank > 3)  # the top 3, and the prompt token where it is not among them
        assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]
    chat_scores = chat["choices"][0]["prompt_logprobs"]
    assert len(chat_scores) == len(chat_ids)
    assert [list(e.values())[0]["logprob"] if e else None for e in chat_scores] == \
        [None] + [s.logprob for s in chat_want.prompt_logprobs[1:]]
    firsts = [e["choices"][0] for e in _events(stream) if e["choices"]]
    assert firsts[0]["prompt_logprobs"] == chat_scores and all("prompt_logprobs" not in c for c in firsts[1:])
