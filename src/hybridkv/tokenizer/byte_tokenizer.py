"""``ByteTokenizer``: token id = UTF-8 byte, for the tiny byte-level test models.

Usage::

    tok = ByteTokenizer(vocab_size=model.vocab_size)   # >= 256
    tok.encode("hé")        # [104, 195, 169]
    tok.decode([104, 195, 169, 300])   # 'hé' (ids >= 256 are the model's own; they print nothing)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.errors import ChatTemplateError, InvalidArgumentError, TokenizerError
from hybridkv.tokenizer.base import check_ids

BYTES = 256


class ByteTokenizer:
    bos_token_id = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template = None
    special_token_ids: frozenset[int] = frozenset()
    byte_fallback_ids: frozenset[int] = frozenset()  # bytes are the vocabulary itself; decode is per-char lossy
    max_token_chars = 1  # a character is one or more tokens (its UTF-8 bytes)

    def __init__(self, vocab_size: int = BYTES):
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < BYTES:
            raise TokenizerError(f"byte-level text needs a vocabulary of >= {BYTES} ids, the model has {vocab_size!r}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text to encode must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in check_ids(ids, self.vocab_size) if i < BYTES).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [f"<0x{i:02X}>" if i < BYTES else f"<id {i}>" for i in check_ids(ids, self.vocab_size)]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise ChatTemplateError("the byte-level tokenizer has no chat template")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"
