"""IncrementalDetokenizer and StopStringMatcher: worked examples and property tests against
the full decode / a brute-force stop reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.texts import texts
from tests.support.tiers import examples, slow_except
from hybridkv.errors import InvalidArgumentError
from hybridkv.tokenizer import ByteTokenizer, IncrementalDetokenizer, StopStringMatcher

SETTINGS = settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    out, at = [], 0
    for step in cuts:
        out.append(detok.add(ids[at : at + step]))
        at += step
    out.append(detok.add(ids[at:]))
    return out


def test_worked_example_byte_fallback(spm_tok):
    ni = [spm_tok.backend.token_to_id(f"<0x{b:02X}>") for b in "你".encode()]
    ok = spm_tok.encode(" ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(spm_tok, spm_tok.encode("Hi"))
    assert detok.add(ni[:1]) == ""
    assert detok.add(ni[1:]) == "你"
    assert detok.add(ok) == " ok"
    assert detok.flush() == "" and detok.text == "你 ok"


def test_flush_returns_an_unfinished_character(spm_tok):
    detok = IncrementalDetokenizer(spm_tok)
    assert detok.add([spm_tok.backend.token_to_id("<0xE4>")]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_skipped_or_kept(bpe_tok):
    ids = bpe_tok.encode("Hi", add_special_tokens=False)
    skip = IncrementalDetokenizer(bpe_tok)
    keep = IncrementalDetokenizer(bpe_tok, skip_special_tokens=False)
    assert skip.add(ids + [2]) + skip.flush() == "Hi"
    assert keep.add(ids + [2]) + keep.flush() == "Hi<|im_end|>"


def test_prompt_context_keeps_leading_space(bpe_tok, spm_tok):
    for tok in (bpe_tok, spm_tok):
        prompt = tok.encode("The capital of France is")
        out = tok.encode(" Paris, of", add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(detok.add([i]) for i in out) == " Paris, of"


def test_bad_ids(bpe_tok):
    detok = IncrementalDetokenizer(bpe_tok)
    with pytest.raises(InvalidArgumentError):
        detok.add([bpe_tok.vocab_size])
    with pytest.raises(InvalidArgumentError):
        IncrementalDetokenizer(bpe_tok, [-1])
    assert detok.add(bpe_tok.encode("ok", add_special_tokens=False)) == "ok"  # state unchanged by the refusal


def test_stop_worked_example():
    m = StopStringMatcher(["</s>", "\n\n"])
    assert m.feed("Hi<") == ("Hi", False)
    assert m.feed("/x") == ("</x", False)
    assert m.feed("y\n") == ("y", False)
    assert m.feed("\nmore") == ("", True)
    assert m.stop == "\n\n" and m.feed("again") == ("", True) and m.flush() == ""


def test_stop_flush_and_none():
    m = StopStringMatcher("END")
    assert m.feed("the EN") == ("the ", False)
    assert m.flush() == "EN"
    assert StopStringMatcher(None).feed("abc") == ("abc", False)


@pytest.mark.parametrize("bad", [[""], [1], "", 5])
def test_stop_bad_input(bad):
    with pytest.raises(InvalidArgumentError):
        StopStringMatcher(bad if bad != "" else [""])
    with pytest.raises(InvalidArgumentError):
        StopStringMatcher(["x"]).feed(None)


# ---------------------------------------------------------------- properties: detokenizer


def _retracting_run(tok, ids: list[int], skip: bool) -> bool:
    """Whether a byte-fallback run in ``ids`` completes a character and also holds invalid bytes:
    tokenizers then decodes the whole run as U+FFFDs, retracting text a stream already showed."""
    if not tok.byte_fallback_ids:
        return False
    hidden = tok.special_token_ids if skip else frozenset()
    runs, run = [], bytearray()
    for token in tok.convert_ids_to_tokens([i for i in ids if i not in hidden]):
        if token is not None and token.startswith("<0x") and len(token) == 6:  # None: an id with no token
            run.append(int(token[3:5], 16))
        else:
            runs.append(bytes(run))
            run = bytearray()
    runs.append(bytes(run))
    for r in runs:
        try:
            r.decode("utf-8")
        except UnicodeDecodeError:
            if r.decode("utf-8", errors="replace").strip("\ufffd"):
                return True
    return False


@st.composite
def id_streams(draw, tok_name: str):
    """Output ids mixing real text, byte-fallback bytes of real characters, random bytes, specials, random ids."""
    return draw(st.lists(st.tuples(st.integers(0, 5), st.text(max_size=4), st.integers(0, 10**6)), max_size=12)), draw(
        st.lists(st.integers(1, 4), max_size=20)
    )


def _ids_from(tok, pieces) -> list[int]:
    ids: list[int] = []
    byte_id = {int(t[3:5], 16): i for i in tok.byte_fallback_ids for t in tok.convert_ids_to_tokens([i])}
    for kind, text, n in pieces:
        if kind <= 1 or (kind == 2 and not byte_id):
            ids += tok.encode(text, add_special_tokens=False)
        elif kind == 2:
            ids += [byte_id[b] for b in text.encode("utf-8", errors="surrogatepass")]
        elif kind == 3 and byte_id:
            ids.append(byte_id[n % 256])
        elif kind == 4 and tok.special_token_ids:
            ids.append(sorted(tok.special_token_ids)[n % len(tok.special_token_ids)])
        else:
            ids.append(n % tok.vocab_size)
    return ids


@pytest.mark.parametrize("name", slow_except(["bpe_tok", "spm_tok", "byte"], 0))
@pytest.mark.parametrize("skip", slow_except([True, False], 1))  # the fast tier: bpe_tok, skip False
def test_deltas_equal_full_decode(request, name, skip):
    tok = ByteTokenizer(300) if name == "byte" else request.getfixturevalue(name)

    @SETTINGS
    @given(st.data())
    def check(data):
        pieces, cuts = data.draw(id_streams(name))
        ids = _ids_from(tok, pieces)
        prompt = tok.encode(data.draw(st.sampled_from(["", "Q:", "The capital of 日本 is", "emoji 😀"])))
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        out = "".join(stream(detok, ids, cuts))
        full = tok.decode(ids, skip_special_tokens=skip)
        if _retracting_run(tok, ids, skip):
            detok.flush()
            return
        if not full.endswith("\ufffd"):
            assert out == full
        assert out + detok.flush() == full
        assert detok.text == full

    check()


def test_deltas_on_realistic_text(bpe_tok, spm_tok):
    rng = random.Random(7)
    for tok in (bpe_tok, spm_tok):
        for text in texts(150, seed=3):
            ids = tok.encode(text, add_special_tokens=False)
            detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"))
            out = stream(detok, ids, [rng.randint(1, 3) for _ in range(len(ids))])
            assert "".join(out) + detok.flush() == tok.decode(ids)
            if tok is bpe_tok:  # byte-level BPE round-trips any text but its special tokens
                for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
                    text = text.replace(special, "")
                assert tok.decode(ids) == text


# ---------------------------------------------------------------- properties: stop strings


def reference_stop(full: str, stops: list[str]) -> tuple[str, bool]:
    """Brute force: the first end position at which some stop string completes."""
    for end in range(1, len(full) + 1):
        done = [s for s in stops if full[:end].endswith(s)]
        if done:
            return full[: end - max(map(len, done))], True
    return full, False


@settings(max_examples=examples(200), deadline=None)
@given(
    st.text(alphabet="ab\n</>", max_size=40),
    st.lists(st.text(alphabet="ab\n</>", min_size=1, max_size=5), min_size=1, max_size=4),
    st.lists(st.integers(0, 6), max_size=20),
)
def test_stop_matcher_equals_brute_force(full, stops, cuts):
    m = StopStringMatcher(stops)
    out, at, stopped = [], 0, False
    for step in [*cuts, len(full)]:
        text, stopped = m.feed(full[at : at + step])
        out.append(text)
        at += step
        if stopped:
            break
    expected, expect_stop = reference_stop(full, stops)
    if not stopped:
        out.append(m.flush())
    assert ("".join(out), stopped) == (expected, expect_stop)


@settings(max_examples=examples(200), deadline=None)
@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=3))
def test_stop_matcher_unicode(full, stops):
    m = StopStringMatcher(stops)
    emitted = ""
    for ch in full:  # one character at a time: the tightest streaming
        text, stopped = m.feed(ch)
        emitted += text
        assert len(m._held) < max(map(len, stops))  # never holds more than a partial stop
        if stopped:
            break
    else:
        emitted += m.flush()
    assert emitted == reference_stop(full, stops)[0]


def test_prompt_ending_in_a_byte_run(spm_tok):
    """The output continues the prompt's byte run: the run is decoded from the output alone."""
    byte = {b: spm_tok.backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    prompt = spm_tok.encode("x") + [byte[b] for b in "😀".encode()]
    detok = IncrementalDetokenizer(spm_tok, prompt)
    out = [detok.add([byte[b]]) for b in "你".encode()] + [detok.add(spm_tok.encode(" ok", add_special_tokens=False))]
    assert "".join(out) == "你 ok"
