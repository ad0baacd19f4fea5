"""Structured outputs on the wire: OpenAI's ``response_format`` (``json_object``, ``json_schema``;
``text`` neutral) and vLLM's ``structured_outputs`` on completions and chat mean what
``SamplingParams.structured_outputs`` means offline; a schema / regex / grammar that does not
compile is a 400 naming the field it came in, and changes nothing.

The tiny model's character vocabulary has letters and digits but no braces or quotes: its JSON
values are booleans and numbers (an object's ``{`` is a dead end there: the request ends with
an error). The openai SDK's ``chat.completions.parse`` (a pydantic model
as ``response_format``) runs on SmolLM2 (slow, real).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")

from hybridkv.sampling_params import SamplingParams  # noqa: E402
from hybridkv.server import ServerConfig  # noqa: E402
from hybridkv.structured_outputs import StructuredOutputsParams as SO  # noqa: E402

from tests.support.tiny_server import run_app  # noqa: E402

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "the quick brown fox"
MSG = [{"role": "user", "content": "hi there"}]


def test_structured_outputs_on_the_wire_equal_offline(tiny_llm):
    cases = [{"regex": "[a-c]{2,6}x"}, {"choice": ["yes", "no", "maybe"]}, {"grammar": 'start: "a" b b b? "z"\nb: "b" | "c"'}]
    offline = [tiny_llm.generate([PROMPT], SamplingParams(max_tokens=30, structured_outputs=SO(**c)))[0] for c in cases]

    async def run(client, front, app):
        comp = [(await client.post(C, json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0,
                                            "structured_outputs": c})).json() for c in cases]
        chat = [(await client.post(CHAT, json={"messages": MSG, "max_tokens": 30, "temperature": 0,
                                               "structured_outputs": c})).json() for c in cases]
        return comp, chat

    (comp, chat), (free, usable) = run_app(tiny_llm, run)
    assert free == usable
    assert [r["choices"][0]["text"] for r in comp] == [o.text for o in offline]
    assert [r["choices"][0]["finish_reason"] for r in comp] == [o.finish_reason for o in offline]
    texts = [r["choices"][0]["message"]["content"] for r in chat]
    assert re.fullmatch("[a-c]{2,6}x", texts[0]) and texts[1] in ("yes", "no", "maybe")
    assert re.fullmatch("a[bc]{2,3}z", texts[2]) and {r["choices"][0]["finish_reason"] for r in chat} == {"stop"}


def test_response_format_json_on_the_tiny_vocabulary(tiny_llm):
    schemas = [{"type": "boolean"}, {"type": "integer", "minimum": 10, "maximum": 99}, {"enum": [7, True, 42]}]

    async def run(client, front, app):
        out = []
        for schema in schemas:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
            out.append((await client.post(CHAT, json={"messages": MSG, "max_tokens": 12, "temperature": 0,
                                                      "response_format": fmt})).json())
        text = {"type": "text"}
        out.append((await client.post(C, json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "response_format": text})).json())
        return out

    out, _ = run_app(tiny_llm, run)
    values = [json.loads(r["choices"][0]["message"]["content"]) for r in out[:3]]
    assert isinstance(values[0], bool) and type(values[1]) is int and 10 <= values[1] <= 99
    assert values[2] in (7, True, 42) and all(r["choices"][0]["finish_reason"] == "stop" for r in out[:3])
    plain = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=6))[0].text
    assert out[3]["choices"][0]["text"] == plain  # {"type": "text"} is no constraint


def test_streamed_structured_chat(tiny_llm):
    async def run(client, front, app):
        body = {"messages": MSG, "max_tokens": 20, "temperature": 0, "stream": True,
                "structured_outputs": {"regex": "[a-e]{3}[0-9]{2}"}}
        async with client.stream("POST", CHAT, json=body) as r:
            return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    lines, (free, usable) = run_app(tiny_llm, run)
    assert lines[-1] == "data: [DONE]" and free == usable
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert re.fullmatch("[a-e]{3}[0-9]{2}", text) and chunks[-1]["choices"][0]["finish_reason"] == "stop"


BAD = [
    (C, {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    (C, {"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    (C, {"structured_outputs": {"choice": []}}, "structured_outputs"),
    (C, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    (C, {"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    (C, {"structured_outputs": "a"}, "structured_outputs"),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"minLength": 5, "maxLength": 1,
                                                                                 "type": "string"}}}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format"),
    (CHAT, {"response_format": {"type": "yaml"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
]


def test_bad_constraints_are_400s_naming_their_field(tiny_llm):
    async def run(client, front, app):
        out = []
        for route, extra in [(r, e) for r, e, _ in BAD]:
            base = {"prompt": PROMPT} if route == C else {"messages": MSG}
            out.append(await client.post(route, json={**base, "max_tokens": 4, **extra}))
        ok = await client.post(C, json={"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": "[ab]+"}})
        return out, ok

    (out, ok), (free, usable) = run_app(tiny_llm, run)
    for r, (_, _, param) in zip(out, BAD):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    assert ok.status_code == 200 and re.fullmatch("[ab]+", ok.json()["choices"][0]["text"])
    assert free == usable and len(tiny_llm.engine.structured) == 0


@pytest.mark.slow
@pytest.mark.real
def test_openai_sdk_parse_on_smollm2():
    """``client.chat.completions.parse(response_format=PydanticModel)``: the SDK sends a strict
    ``json_schema`` and parses the reply into the model."""
    openai = pytest.importorskip("openai")
    from typing import Literal

    import httpx
    from pydantic import BaseModel, Field

    from hybridkv.checkpoint.installed import resolve_model
    from hybridkv.engine.engine import EngineConfig
    from hybridkv.engine.llm import LLM
    from hybridkv.errors import ModelNotInstalledError

    try:
        source = resolve_model("smollm2-135m")
    except ModelNotInstalledError as exc:
        pytest.skip(str(exc))
    llm = LLM(source, EngineConfig(max_model_len=1024))

    class Country(BaseModel):  # bounded fields: a 135M model loops in an unbounded list or number
        name: str = Field(max_length=24)
        capital: str = Field(max_length=24)
        continent: Literal["Europe", "Asia", "Africa", "Americas", "Oceania"]
        in_european_union: bool

    async def run(client, front, app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
        done = await oai.chat.completions.parse(
            model="smol", messages=[{"role": "user", "content": "Give facts about France as JSON."}],
            response_format=Country, max_tokens=120, temperature=0)
        await http.aclose()
        return done

    done, (free, usable) = run_app(llm, run, config=ServerConfig(model_name="smol"))
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Country), choice.message.content
    assert choice.message.parsed.capital == "Paris" and choice.message.parsed.continent == "Europe"
    assert free == usable
