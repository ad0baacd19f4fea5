"""Each token id's raw bytes, read from the vocabulary itself (what grammar engines need).

    vocab = token_bytes(tok, model.vocab_size)      # list[bytes], one per id; b"" for ids with no text
    TokenSpeller(tok, vocab)(b"x")                  # ids whose bytes are exactly b"x"

Decoding ids one at a time does not give them: a SentencePiece decoder strips the leading
space of a text's first token (``▁Hello`` alone decodes to ``Hello``), and a lone byte of a
multi-byte character decodes to U+FFFD. Here each vocabulary string goes through the per-token
steps of the tokenizer's own decoder (``tokenizers``' decoder JSON), never through the steps
that act on a whole text:

- ``ByteLevel`` (GPT-2 BPE: SmolLM2): each character is the byte it spells (``Ġ`` -> ``0x20``;
  a token with a character outside that alphabet is its UTF-8, as ``tokenizers`` decodes it);
- ``Metaspace`` / ``Replace`` (SentencePiece: Gemma, the tiny test tokenizer): ``▁`` -> space,
  kept at the start of every token;
- ``ByteFallback``: ``<0xNN>`` -> the byte ``NN``;
- ``Fuse`` and ``Strip`` act on the joined text (a ``Strip`` after ``Fuse`` removes the text's
  first space only) and are skipped.

A decoder with any other step (WordPiece's ``##``, CTC, ...) is a TokenizerError naming it.
Added tokens (special ones included) go through the same steps, as ``decode`` sends them.
The byte-level :class:`~hybridkv.tokenizer.ByteTokenizer` is its own table (id = byte).
Ids past the tokenizer's (a model vocabulary padded to a multiple of 64) get ``b""``.

Torch-free; reads ``tokenizers`` objects it is handed, imports nothing heavy.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from hybridkv.errors import TokenizerError
from hybridkv.tokenizer.byte_tokenizer import BYTES, ByteTokenizer
from hybridkv.tokenizer.gguf_vocab import bytes_to_unicode

__all__ = ["TokenSpeller", "token_bytes"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: decoder steps that act on the joined text, not on a token's own characters
_WHOLE_TEXT = frozenset({"Fuse", "Strip"})


def token_bytes(tokenizer: Any, vocab_size: int | None = None) -> list[bytes]:
    """``vocab_size`` (default: the tokenizer's) byte strings, one per id (see the module
    docstring). TokenizerError: a tokenizer or decoder step this does not know, or a
    ``vocab_size`` below the tokenizer's."""
    own = getattr(tokenizer, "vocab_size", None)
    if not isinstance(own, int):
        raise TokenizerError(f"cannot read the token bytes of a {type(tokenizer).__name__}")
    size = own if vocab_size is None else vocab_size
    if size < own:
        raise TokenizerError(f"vocab_size {size} is below the tokenizer's {own} ids")
    if isinstance(tokenizer, ByteTokenizer):
        return [bytes((i,)) for i in range(BYTES)] + [b""] * (size - BYTES)
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        raise TokenizerError(f"cannot read the token bytes of a {type(tokenizer).__name__}")
    to_bytes = _token_to_bytes(backend)
    out = [b""] * size
    for text, token_id in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= token_id < size:
            out[token_id] = to_bytes(text)
    return out


def _decoder_steps(backend: Any) -> list[dict]:
    """The decoder's steps as JSON dicts (a ``Sequence`` flattened; none: ``[]``)."""
    decoder = backend.decoder
    if decoder is None:
        return []
    spec = json.loads(decoder.__getstate__())
    steps: list[dict] = []

    def walk(d: dict) -> None:
        if d.get("type") == "Sequence":
            for inner in d.get("decoders", ()):
                walk(inner)
        else:
            steps.append(d)

    walk(spec)
    return steps


def _token_to_bytes(backend: Any) -> Callable[[str], bytes]:
    """A function from a vocabulary string to its bytes, per the decoder's per-token steps."""
    ops: list[Callable[[str | bytes], str | bytes]] = []
    for step in _decoder_steps(backend):
        kind = step.get("type")
        if kind == "ByteLevel":
            ops.append(_byte_level())
        elif kind == "Metaspace":
            ops.append(_replace(step.get("replacement", "\u2581"), " "))
        elif kind == "Replace":
            pattern = step.get("pattern", {})
            if "String" not in pattern:
                raise TokenizerError(f"cannot read token bytes through a regex Replace decoder step: {step!r:.120}")
            ops.append(_replace(pattern["String"], step.get("content", "")))
        elif kind == "ByteFallback":
            ops.append(_byte_fallback)
        elif kind not in _WHOLE_TEXT:
            raise TokenizerError(f"cannot read token bytes through a {kind!r} decoder step")

    def convert(text: str) -> bytes:
        value: str | bytes = text
        for op in ops:
            value = op(value)
        return value if isinstance(value, bytes) else value.encode("utf-8")

    return convert


def _byte_level() -> Callable[[str | bytes], str | bytes]:
    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def op(value: str | bytes) -> str | bytes:
        if isinstance(value, bytes):
            return value
        try:
            return bytes(byte_of[c] for c in value)
        except KeyError:  # a character outside GPT-2's alphabet (an added token's): its UTF-8, as tokenizers does
            return value.encode("utf-8")

    return op


def _replace(old: str, new: str) -> Callable[[str | bytes], str | bytes]:
    def op(value: str | bytes) -> str | bytes:
        return value.replace(old, new) if isinstance(value, str) else value

    return op


def _byte_fallback(value: str | bytes) -> str | bytes:
    if isinstance(value, str):
        m = _BYTE_TOKEN.fullmatch(value)
        if m is not None:
            return bytes((int(m.group(1), 16),))
    return value


class TokenSpeller:
    """Bytes -> token ids whose :func:`token_bytes` concatenate to exactly those bytes (what a
    grammar engine asks of a tokenizer): the tokenizer's own ids when they do, less the prefix
    space a SentencePiece tokenizer puts before a text's first word (``encode("x")`` is
    ``▁x``); else (that space merged into a token, bytes that are not UTF-8) the longest
    vocabulary match at each position, special tokens left out. A byte no token spells ends
    the ids there."""

    def __init__(self, tokenizer: Any, tokens: list[bytes], special_ids: Any = ()) -> None:
        self._encode = tokenizer.encode
        self._tokens = tokens
        self._special = frozenset(special_ids)
        self._by_bytes: dict[bytes, int] | None = None
        self._longest = 1

    def __call__(self, data: bytes) -> list[int]:
        ids = self._encode(data.decode("utf-8", errors="replace"), add_special_tokens=False)
        tokens = self._tokens
        spelled = b"".join(tokens[i] for i in ids)
        if spelled == data:
            return ids
        if ids and spelled == b" " + data and tokens[ids[0]] == b" ":
            return ids[1:]
        return self._longest_match(data)

    def _longest_match(self, data: bytes) -> list[int]:
        if self._by_bytes is None:
            self._by_bytes = {}
            for i, b in enumerate(self._tokens):
                if b and i not in self._special:
                    self._by_bytes.setdefault(b, i)
            self._longest = max(map(len, self._by_bytes), default=1)
        by_bytes, out, pos = self._by_bytes, [], 0
        while pos < len(data):
            for n in range(min(self._longest, len(data) - pos), 0, -1):
                token = by_bytes.get(data[pos : pos + n])
                if token is not None:
                    out.append(token)
                    pos += n
                    break
            else:
                break
        return out
