"""Prompts to token ids, and the tokenizer a checkpoint carries (torch-free: the engine's
text front and the router encode prompts the same way).

A prompt is a ``str`` (encoded with the tokenizer's special tokens: Gemma's BOS), a chat
(a list of ``{"role", "content"}`` dicts, rendered with the tokenizer's chat template and
encoded with ``add_special_tokens=False``, as transformers' ``apply_chat_template``), or a
list of token ids (returned as given; the engine checks them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from hybridkv.errors import InvalidArgumentError, TokenizerError

__all__ = ["Prompt", "checkpoint_tokenizer", "encode_prompt", "min_tokens"]

#: text, chat messages, or token ids
Prompt = Union[str, Sequence[Mapping[str, Any]], Sequence[int]]


def checkpoint_tokenizer(source: Any, model_vocab_size: int):
    """The tokenizer a checkpoint carries: GGUF metadata, or ``tokenizer.json`` in the model
    directory; byte-level for a directory without one when the model has >= 256 ids; else None."""
    from hybridkv import tokenizer as tk

    kind = getattr(source, "kind", None)
    if kind == "gguf":
        from hybridkv.checkpoint.gguf_file import GGUFFile

        return tk.tokenizer_from_gguf(GGUFFile.open(source.path).metadata)
    if kind == "dir":
        if (Path(source.path) / "tokenizer.json").is_file():
            return tk.load_tokenizer(source.path)
    if model_vocab_size >= 256:
        return tk.ByteTokenizer(vocab_size=model_vocab_size)
    return None


def _need_tokenizer(tokenizer: Any, what: str, vocab_size: int):
    if tokenizer is None:
        raise TokenizerError(
            f"{what} needs a tokenizer; the model has none (no tokenizer.json or GGUF vocabulary, and "
            f"{vocab_size} ids < 256 for the byte-level one): give token ids"
        )
    return tokenizer


def check_token_ids(ids: Sequence[Any], vocab_size: int, param: str | None = None) -> None:
    """Refuse (InvalidArgumentError naming ``param``) ids that are not ints in ``[0, vocab_size)``:
    the one rule the engine, the runner and the server apply where ids enter."""
    bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]  # bool is not a token id
    if bad:
        raise InvalidArgumentError(f"token ids must be ints in [0, {vocab_size}); got {bad[:5]}", param=param)


def encode_prompt(tokenizer: Any, prompt: Prompt, vocab_size: int, tools: list | None = None) -> list[int]:
    """A prompt's token ids: text encoded with special tokens, chat messages rendered with the
    chat template (``tools``, if any, as its ``tools`` variable) and encoded without, token ids
    as given (the engine checks them). ``vocab_size`` (the model's) only words the error when
    there is no tokenizer."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("a prompt is empty")
        return _need_tokenizer(tokenizer, "a text prompt", vocab_size).encode(prompt)
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise InvalidArgumentError(f"a prompt is a str, a list of chat messages or of token ids; got {prompt!r:.60}")
    items = list(prompt)
    if not items:
        raise InvalidArgumentError("a prompt is empty")
    if not any(isinstance(m, Mapping) for m in items):
        return items  # token ids
    for i, m in enumerate(items):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidArgumentError(f"chat message {i} needs a str 'role' and 'content', got {m!r:.80}")
    tok = _need_tokenizer(tokenizer, "a chat prompt", vocab_size)
    extra = {"tools": tools} if tools else {}
    text = tok.apply_chat_template([dict(m) for m in items], add_generation_prompt=True, **extra)
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidArgumentError("the chat template rendered an empty prompt")
    return ids


def min_tokens(tokenizer: Any, num_chars: int) -> int:
    """A lower bound, without tokenizing, on the tokens of a text of ``num_chars`` characters:
    ``num_chars // (2 * max_token_chars)`` (the factor 2 covers normalizers that merge
    characters); 0 when the tokenizer does not say how long its tokens are. A server refuses
    a prompt by it before paying for the tokenization of megabytes."""
    longest = getattr(tokenizer, "max_token_chars", None)
    if not isinstance(longest, int) or longest < 1:
        return 0
    return num_chars // (2 * longest)
