"""Penalties, logit bias and min_tokens on the wire mean what they mean offline (the same
SamplingParams through the offline engine), and neutral values (``{}``, 0, 1) change nothing."""

from __future__ import annotations

from hybridkv.scheduler.interface import SamplingParams

from tests.support.tiny_server import run_app

C = "/v1/completions"
PROMPT = "the quick brown fox jumps over the lazy dog"


def test_penalties_bias_and_min_tokens_equal_offline(tiny_llm):
    cases = [
        {"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.5, "presence_penalty": -1.0}, {"logit_bias": {"66": 100}},
        {"logit_bias": {"66": 7.5, "67": -100}, "frequency_penalty": 0.5}, {"min_tokens": 6},
    ]
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
               "min_tokens": 0}
    base = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    offline = []
    for fields in cases:
        sp = dict(fields)
        if "logit_bias" in sp:
            sp["logit_bias"] = {int(k): v for k, v in sp["logit_bias"].items()}
        offline.append(tiny_llm.generate([PROMPT], SamplingParams(max_tokens=10, **sp))[0].text)
    plain = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=10))[0].text

    async def run(client, front, app):
        got = [(await client.post(C, json={**base, **f})).json() for f in cases]
        same = (await client.post(C, json={**base, **neutral})).json()
        return got, same

    (got, same), (free, usable) = run_app(tiny_llm, run)
    assert free == usable
    assert [g["choices"][0]["text"] for g in got] == offline
    assert same["choices"][0]["text"] == plain
    assert sum(t != plain for t in offline) >= 5  # the cases do change the text
    bias_all = got[4]["choices"][0]["text"]
    assert bias_all == tiny_llm.tokenizer.decode([66] * 10)  # +100 on one token: only that token
