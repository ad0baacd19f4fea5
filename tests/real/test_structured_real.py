"""Structured outputs on the installed real models (SmolLM2-135M-Instruct, Gemma 3 270M).

- token bytes: for both GGUF tokenizers (byte-level BPE; Gemma's SentencePiece with ``▁`` and
  ``<0xNN>`` byte tokens) the joined bytes of a text's tokens are the text;
- randomized JSON schemas (objects, arrays, enums, nesting, bounded integers and numbers, bounded
  strings, optional fields), one batch of chat requests on SmolLM2 with greedy decoding: every
  output that ends with ``"stop"`` parses and validates (a validator for the generated subset,
  written here), and most of them do end;
- a regex and a choice on Gemma.
"""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("llguidance")

from hybridkv.engine.engine import EngineConfig  # noqa: E402
from hybridkv.engine.llm import LLM  # noqa: E402
from hybridkv.sampling_params import SamplingParams  # noqa: E402
from hybridkv.structured_outputs import StructuredOutputsParams as SO  # noqa: E402
from hybridkv.tokenizer.token_bytes import token_bytes  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

TEXTS = ["Hello world, this is  a test.\n\n  {\"a\": 12.5, \"é世界\": [true, null]}", " leading space",
         "x  y\t\tz 😀 ñ", "<|im_start|> not special as text", "   \n\t"]
NAMES = ["id", "name", "age", "score", "tags", "kind", "items", "size", "ok", "note"]
WORDS = ["alpha", "beta", "gamma", "red", "blue", "north", "south"]


@pytest.fixture(scope="module")
def smollm(our_smollm):
    return LLM(our_smollm, EngineConfig(max_model_len=2048))


@pytest.mark.parametrize("which", ["our_smollm", "our_gemma"])
def test_token_bytes_spell_the_text(which, request):
    from hybridkv.tokenizer.prompts import checkpoint_tokenizer

    model = request.getfixturevalue(which)
    tok = checkpoint_tokenizer(model.source, model.vocab_size)
    table = token_bytes(tok, model.vocab_size)
    assert len(table) == model.vocab_size
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode(), text
    assert all(table[i] for i in range(tok.vocab_size)), "every id of the tokenizer has bytes"


def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema of the subset :func:`valid` checks."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(NAMES, rng.randint(1, 4))
        required = [n for n in names if rng.random() < 0.7]
        return {"type": "object", "properties": {n: gen_schema(rng, depth + 1) for n in names},
                "required": required, "additionalProperties": False}
    if kind == "array":
        lo = rng.randint(0, 1)
        return {"type": "array", "items": gen_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(1, 3)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, 2) + ([rng.randint(0, 9)] if rng.random() < 0.5 else [])}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 16)}
    if kind in ("integer", "number"):
        lo = rng.randint(-50, 50)
        return {"type": kind, "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    return {"type": "boolean"}


def valid(schema: dict, v) -> bool:
    """``v`` against a schema of :func:`gen_schema`'s subset."""
    if "enum" in schema:
        return any(v == e and type(v) is type(e) for e in schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(v, dict) and set(v) <= set(props) and set(schema["required"]) <= set(v)
                and all(valid(props[k], x) for k, x in v.items()))
    if kind == "array":
        return (isinstance(v, list) and schema["minItems"] <= len(v) <= schema["maxItems"]
                and all(valid(schema["items"], x) for x in v))
    if kind == "string":
        return isinstance(v, str) and schema["minLength"] <= len(v) <= schema["maxLength"]
    if kind == "integer":
        return type(v) is int and schema["minimum"] <= v <= schema["maximum"]
    if kind == "number":
        return type(v) in (int, float) and schema["minimum"] <= v <= schema["maximum"]
    return type(v) is bool


def test_valid_is_not_vacuous():
    s = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                          "b": {"enum": ["x", 1]}}, "required": ["a"], "additionalProperties": False}
    assert valid(s, {"a": 2}) and valid(s, {"a": 0, "b": 1})
    assert not valid(s, {"b": "x"}) and not valid(s, {"a": 4}) and not valid(s, {"a": True})
    assert not valid(s, {"a": 1, "b": True}) and not valid(s, {"a": 1, "c": 2}) and not valid(s, [1])


def test_random_schemas_on_smollm2_validate(smollm):
    rng = random.Random(1234)
    schemas = []
    while len(schemas) < 8:
        s = gen_schema(rng)
        if s.get("type") == "object":
            schemas.append(s)
    chats = [[{"role": "user", "content": f"Reply with a JSON object for this schema: {json.dumps(s)}"}] for s in schemas]
    params = [SamplingParams(max_tokens=200, structured_outputs=SO(json=s)) for s in schemas]
    outs = smollm.generate(chats, params)
    stopped = [(s, o) for s, o in zip(schemas, outs) if o.finish_reason == "stop"]
    for s, o in stopped:
        assert valid(s, json.loads(o.text)), (s, o.text)
    assert {o.finish_reason for o in outs} <= {"stop", "length"}
    assert len(stopped) >= 6, [o.text[-80:] for o in outs]


def test_regex_and_choice_on_gemma(our_gemma):
    llm = LLM(our_gemma, EngineConfig(max_model_len=512))
    chat = ["<start_of_turn>user\nWhat is the capital of France? Answer briefly.<end_of_turn>\n<start_of_turn>model\n"]
    outs = llm.generate(chat * 2, [SamplingParams(max_tokens=12, structured_outputs=SO(choice=["Paris", "Lyon", "Nice"])),
                                   SamplingParams(max_tokens=24, structured_outputs=SO(regex=r"The answer is [A-Z][a-z]+\."))])
    assert outs[0].finish_reason == "stop" and outs[0].text in ("Paris", "Lyon", "Nice")
    assert outs[1].finish_reason == "stop" and re.fullmatch(r"The answer is [A-Z][a-z]+\.", outs[1].text)
