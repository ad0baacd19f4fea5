""":class:`~hybridkv.protocol.value_count.ValueCounter` against a byte-at-a-time reference over
random JSON (strings full of commas, quotes and backslashes) cut into random chunks, and
:class:`~hybridkv.protocol.limits.BodyLimit` refusing a body of too many values before its
end arrives (in-process, on the tiny model)."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.protocol.limits import too_many_values_body
from hybridkv.protocol.value_count import ValueCounter

from tests.support.tiers import examples
from tests.support.tiny_server import run_app


def reference(data: bytes) -> int:
    """Commas outside strings, one byte at a time."""
    commas, inside, escape = 0, False, False
    for b in data:
        if inside:
            if escape:
                escape = False
            elif b == 0x5C:
                escape = True
            elif b == 0x22:
                inside = False
        elif b == 0x22:
            inside = True
        elif b == 0x2C:
            commas += 1
    return commas


_text = st.text(alphabet=st.sampled_from(list(',"\\ab{}[]:\u00e9\n')), max_size=12)
_json = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | _text,
                     lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_text, inner, max_size=5),
                     max_leaves=40)


@settings(max_examples=examples(300), deadline=None)
@given(value=_json, cuts=st.lists(st.integers(0, 10**6), max_size=12), ascii_only=st.booleans())
def test_counts_equal_the_byte_reference_at_any_chunking(value, cuts, ascii_only):
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    points = sorted({c % (len(data) + 1) for c in cuts})
    counter, last, seen = ValueCounter(), 0, []
    for p in [*points, len(data)]:
        seen.append(counter.feed(data[last:p]))
        last = p
    assert seen[-1] == reference(data)
    assert seen == sorted(seen)  # a running total


def test_malformed_and_raw_bytes_match_the_reference_too():
    rng = random.Random(7)
    for _ in range(200):
        data = bytes(rng.choice(b',"\\ab[]{}') for _ in range(rng.randint(0, 60)))
        counter = ValueCounter()
        i = 0
        while i < len(data):
            j = i + rng.randint(0, 5)
            counter.feed(data[i:j])
            i = j
        assert counter.commas == reference(data), data


def test_a_body_of_too_many_values_is_refused_before_its_end(tiny_llm):
    """1.5M token ids, sent in 64 KB chunks: 413 after the chunks that show more values than
    any request can use; the body's end is never read (the generator is not run out)."""
    ids = json.dumps({"model": "tiny", "prompt": list(range(1, 100)) * 15000, "max_tokens": 1}).encode()
    sent = []

    async def chunks():
        for i in range(0, len(ids), 65536):
            sent.append(i)
            yield ids[i:i + 65536]

    async def body(client, front, app):
        limit = app.state.serving.max_body_values
        r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        ok = await client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(1, 100)),
                                                        "max_tokens": 1, "stop_token_ids": list(range(128))})
        return limit, r, ok

    (limit, r, ok), (free, usable) = run_app(tiny_llm, body)
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert r.json() == json.loads(too_many_values_body(limit))
    assert limit == 64 * 256 + tiny_llm.model.vocab_size
    assert len(sent) * 65536 < len(ids) / 10  # refused within the first tenth of the body
    assert ok.status_code == 200, ok.text
    assert free == usable
