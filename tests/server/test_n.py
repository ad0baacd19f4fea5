"""``n`` samples on the wire: choice ``i * n + j`` is prompt ``i``'s sample ``j`` (seed + j), equal to
the offline front's; usage counts each prompt once; streaming gives every choice its role and
finish; the pool is whole afterwards."""

from __future__ import annotations

import json

from hybridkv.scheduler.interface import SamplingParams

from tests.support.tiny_server import run_app

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "count with me"}]


def test_n_samples_equal_the_offline_front(tiny_llm):
    prompts = ["hello world", "the quick brown fox"]
    sp = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=42, ignore_eos=True)
    offline = [o.text for o in tiny_llm.generate(prompts, sp)]
    chat_offline = [o.text for o in tiny_llm.generate([MSG], SamplingParams(n=2, max_tokens=5, temperature=0.8,
                                                                           seed=9, ignore_eos=True))]
    body = {"prompt": prompts, "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 42, "ignore_eos": True}

    async def run(client, front, app):
        whole = (await client.post(C, json=body)).json()
        streamed = (await client.post(C, json={**body, "stream": True,
                                               "stream_options": {"include_usage": True}})).text
        chat = (await client.post(CHAT, json={"messages": MSG, "n": 2, "max_tokens": 5, "temperature": 0.8,
                                              "seed": 9, "ignore_eos": True})).json()
        return whole, streamed, chat

    (whole, streamed, chat), (free, usable) = run_app(tiny_llm, run)
    assert free == usable
    choices = sorted(whole["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(6)) and [c["text"] for c in choices] == offline
    num_prompt = [len(tiny_llm.encode(p)) for p in prompts]
    assert whole["usage"]["prompt_tokens"] == sum(num_prompt) and whole["usage"]["completion_tokens"] == 36
    events = [json.loads(b[6:]) for b in streamed.split("\n\n") if b.startswith("data: {")]
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(6)] == offline
    assert events[-1]["usage"] == whole["usage"]
    assert [c["message"]["content"] for c in sorted(chat["choices"], key=lambda c: c["index"])] == chat_offline
    assert chat["usage"]["prompt_tokens"] == len(tiny_llm.encode(MSG))
