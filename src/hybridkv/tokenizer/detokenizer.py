"""``IncrementalDetokenizer``: text deltas from a growing list of output ids (vLLM's offsets).

Each step decodes two short windows that start at ``prefix`` (a token boundary already turned
into text): ``ids[prefix:read]`` (text already emitted) and ``ids[prefix:]``; the difference is
the new text. Decoding from the same start keeps decoder context (SentencePiece's leading-space
strip, byte-level merges across tokens) equal on both sides. Text is held back while it ends in
U+FFFD: a multi-byte UTF-8 character split across tokens is not complete yet.

Worked example (Gemma, ``你`` = bytes E4 BD A0 as byte-fallback tokens)::

    add([<0xE4>])          -> ''       (window text '\ufffd': held)
    add([<0xBD>, <0xA0>])  -> '你'
    add([▁ok])             -> ' ok'

So the concatenated deltas equal ``decode(output ids)`` whenever that decode does not end in
U+FFFD, with one exception inherited from ``tokenizers``: it decodes a run of byte tokens as one
string, all U+FFFD if any byte in it is invalid, so a run that completes a character and then
continues with invalid bytes retracts text already streamed (a model emitting broken UTF-8; we
keep the streamed character). ``flush()`` returns what is held at the end of a stream. With a
prompt, its last few ids give the first output token its context (a leading ``▁`` is a space
after a prompt); a prompt ending in a byte run gives none (its run could go on).

Usage::

    detok = IncrementalDetokenizer(tok, prompt_ids)
    for new_ids in steps:
        print(detok.add(new_ids), end="")
    print(detok.flush())
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.tokenizer.base import Tokenizer, check_ids

#: prompt ids kept as decoding context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
PROMPT_CONTEXT = 5
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        self._hidden = frozenset(getattr(tokenizer, "special_token_ids", ())) if skip_special_tokens else frozenset()
        self._bytes = frozenset(getattr(tokenizer, "byte_fallback_ids", ()))
        context = check_ids(prompt_ids, tokenizer.vocab_size)[-PROMPT_CONTEXT:]
        if self._pending_run(context):  # the prompt ends in a byte run the output could continue
            context = []
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self.text = ""  # everything returned so far

    def add(self, new_ids: Sequence[int]) -> str:
        """The text ``new_ids`` complete (possibly '', when it is held back)."""
        self._ids.extend(check_ids(new_ids, self.tokenizer.vocab_size))
        prefix_text, new_text = self._windows()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """Whatever is held back (an unfinished character decodes as U+FFFD), at the end of a stream."""
        prefix_text, new_text = self._windows()
        return self._emit(new_text[len(prefix_text) :])

    def _windows(self) -> tuple[str, str]:
        decode, ids = self.tokenizer.decode, self._ids
        prefix_text = decode(ids[self._prefix : self._read], skip_special_tokens=self.skip_special_tokens)
        new_text = decode(ids[self._prefix :], skip_special_tokens=self.skip_special_tokens)
        return prefix_text, new_text

    def _emit(self, delta: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def _pending_run(self, ids: Sequence[int]) -> bool:
        """Whether the last visible id of ``ids`` is a byte-fallback token (its run may go on)."""
        if not self._bytes:
            return False
        for i in reversed(ids):
            if i not in self._hidden:
                return i in self._bytes
        return False
