"""The ``Tokenizer`` protocol every text front talks to, and the vocabulary check.

Usage::

    tok = load_tokenizer("models/smollm2")            # or tokenizer_from_gguf(GGUFFile.open(p).metadata)
    check_vocab(tok, model.vocab_size)                # a mismatched tokenizer fails here, not mid-generation
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from hybridkv.errors import InvalidArgumentError, TokenizerError


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int  # ids the tokenizer can produce (incl. added tokens)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # from the tokenizer's own files / GGUF metadata
    chat_template: str | None
    special_token_ids: frozenset[int]  # ids decode(skip_special_tokens=True) leaves out
    byte_fallback_ids: frozenset[int]  # <0xXX> byte tokens whose run decodes as one UTF-8 string

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Refuse a tokenizer whose ids (or special ids) do not fit the model's embedding rows.

    A model may have more rows than its tokenizer has ids (vocabularies padded to a multiple
    of 64/128 are common); fewer means the tokenizer belongs to another model.
    """
    if not isinstance(model_vocab_size, int) or isinstance(model_vocab_size, bool) or model_vocab_size <= 0:
        raise InvalidArgumentError(f"model vocabulary size must be a positive int, got {model_vocab_size!r}")
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"the tokenizer has {tokenizer.vocab_size:,} ids but the model's vocabulary has {model_vocab_size:,}: "
            f"they do not belong together"
        )
    named = [("bos", i) for i in ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else [])]
    named += [("eos", i) for i in tokenizer.eos_token_ids]
    for what, token_id in named:
        if not 0 <= token_id < model_vocab_size:
            raise TokenizerError(f"the tokenizer's {what} id {token_id} is outside the model's vocabulary of {model_vocab_size:,}")


def check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as a list of ints in ``[0, vocab_size)``, else ``InvalidArgumentError``."""
    if isinstance(ids, (str, bytes)):
        raise InvalidArgumentError(f"token ids must be a sequence of ints, got {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise InvalidArgumentError(f"token id {i!r} is not an int")
        i = operator.index(i)
        if not 0 <= i < vocab_size:
            raise InvalidArgumentError(f"token id {i} is outside the tokenizer's {vocab_size:,} ids")
        out.append(i)
    return out
