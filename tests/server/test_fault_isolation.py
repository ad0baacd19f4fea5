"""One request's failure stays its own, through the app: extreme sampling values are served
(never an engine failure), a request the model fails on gets a 500 (or an SSE error event)
while the streams beside it complete with the offline engine's text, and the pool is whole."""

from __future__ import annotations

import asyncio
import json
import sys

from hybridkv.scheduler.interface import SamplingParams

from tests.support.tiny_server import run_app

INNOCENT = ["hello world", "the quick brown fox", "Zebra 42!"]
HOSTILE = [
    {"temperature": 1e-300}, {"top_p": 5e-324, "temperature": 1.0}, {"temperature": sys.float_info.max},
    {"temperature": 1e-38, "top_k": 1}, {"temperature": 5e-324, "top_p": 1e-300, "seed": 3},
    {"temperature": 2.0, "top_k": 2**62, "top_p": 1.0},
]


def _text_of(stream_body: str) -> tuple[str, list]:
    text, errors = "", []
    for block in stream_body.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        event = json.loads(block[len("data: "):])
        if "error" in event:
            errors.append(event)
        else:
            text += "".join(c.get("text", "") for c in event["choices"])
    return text, errors


async def _innocents(client) -> list[tuple[str, list]]:
    async def one(prompt):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                      "ignore_eos": True, "stream": True})
        assert r.status_code == 200
        return _text_of(r.text)

    return await asyncio.gather(*(one(p) for p in INNOCENT))


def test_extreme_sampling_values_are_served_beside_other_streams(tiny_llm):
    offline = [o.text for o in tiny_llm.generate(INNOCENT, SamplingParams(max_tokens=16, ignore_eos=True))]
    greedy = tiny_llm.generate(["hostile"], SamplingParams(max_tokens=8, ignore_eos=True))[0].text

    async def body(client, front, app):
        async def hostile(fields):
            r = await client.post("/v1/completions", json={"prompt": "hostile", "max_tokens": 8, "ignore_eos": True,
                                                          **fields})
            return fields, r.status_code, r.json()

        results = await asyncio.gather(_innocents(client), *(hostile(f) for f in HOSTILE))
        return results, front.num_engine_errors

    (results, engine_errors), (free, usable) = run_app(tiny_llm, body)
    innocents, hostile = results[0], results[1:]
    assert engine_errors == 0 and free == usable
    assert [t for t, _ in innocents] == offline and all(not e for _, e in innocents)
    for fields, status, reply in hostile:
        assert status == 200, (fields, reply)
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 8
        if fields.get("temperature", 1.0) < 1e-5 or fields.get("top_p", 1.0) < 1e-30 or fields.get("top_k") == 1:
            assert choice["text"] == greedy, fields  # tiny temperature / top-p / top-k 1: greedy


def test_a_request_the_model_fails_on_ends_alone(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    poison = tiny_llm.encode("poison pill")
    real = engine.runner.execute

    def execute(output):
        for sr in output.scheduled:
            seq = engine.scheduler.sequences[sr.request_id]
            if seq.request.all_token_ids[: len(poison)] == poison and sr.num_computed_tokens + len(sr.token_ids) > 3:
                raise RuntimeError("secret kernel detail")
        return real(output)

    monkeypatch.setattr(engine.runner, "execute", execute)
    offline = [o.text for o in tiny_llm.generate(INNOCENT, SamplingParams(max_tokens=16, ignore_eos=True))]

    async def body(client, front, app):
        async def poisoned(stream):
            r = await client.post("/v1/completions", json={"prompt": "poison pill", "max_tokens": 12,
                                                          "ignore_eos": True, "stream": stream})
            return r.status_code, r.text

        results = await asyncio.gather(_innocents(client), poisoned(False), poisoned(True))
        after = await client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True})
        return results, after.json(), front.num_engine_errors

    ((innocents, plain, stream), after, engine_errors), (free, usable) = run_app(tiny_llm, body)
    assert engine_errors == 0  # the engine isolated it: the front never failed everyone
    assert [t for t, _ in innocents] == offline and all(not e for _, e in innocents)
    status, text = plain
    assert status == 500 and json.loads(text)["error"]["type"] == "server_error" and "secret" not in text
    status, text = stream
    _, errors = _text_of(text)
    assert status == 200 and errors and "secret" not in text and text.rstrip().endswith("data: [DONE]")
    assert after["choices"][0]["text"] == offline[0]
    assert engine.scheduler.num_rolled_back_steps >= 1 and not engine.scheduler.suspects
    assert free == usable
    engine.scheduler.check_invariants()
