"""IncrementalDetokenizer and StopStringMatcher: worked examples and property tests against
the full decode / a brute-force stop reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _texts import texts
from hybridkv.errors import InvalidArgumentError
from hybridkv.tokenizer import ByteTokenizer, IncrementalDetokenizer, StopStringMatcher

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


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
