"""``HFTokenizer``: the ``Tokenizer`` protocol over a ``tokenizers.Tokenizer``, and ``load_tokenizer``.

``load_tokenizer(model_dir)`` reads ``tokenizer.json`` and, as transformers does, the special
tokens, ``add_bos_token`` / ``add_eos_token``, ``added_tokens_decoder`` and the chat template from
``tokenizer_config.json`` (``special_tokens_map.json``, ``chat_template.jinja`` /
``chat_template.json`` too). EOS ids from ``generation_config.json`` are the engine's business.

Usage::

    tok = load_tokenizer("models/smollm2")
    tok.encode("Hello")                    # == transformers' tokenizer("Hello").input_ids
    tok.decode(tok.encode("Hello"))        # 'Hello'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.errors import InvalidArgumentError, TokenizerError
from hybridkv.tokenizer.base import check_ids
from hybridkv.tokenizer.chat import render_chat_template

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
#: texts of at least this many characters are encoded with the GIL released
RELEASE_GIL_CHARS = 1 << 16


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` plus what transformers keeps beside it (special tokens, template)."""

    def __init__(
        self,
        backend: Any,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Sequence[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ):
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        eos = self._id_of(self.special_tokens.get("eos_token"))
        self.eos_token_ids = tuple(dict.fromkeys([*([eos] if eos is not None else []), *extra_eos_ids]))
        self.byte_fallback_ids = self._byte_fallback_ids()
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        self._max_token_chars: int | None = None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _byte_fallback_ids(self) -> frozenset[int]:
        if not getattr(self.backend.model, "byte_fallback", False):
            return frozenset()
        ids = (self.backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. A long text goes through ``encode_batch``, which releases the
        GIL while it works (``encode`` holds it: a server's other threads would stall)."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text to encode must be a str, got {type(text).__name__}")
        if len(text) >= RELEASE_GIL_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=bool(add_special_tokens))[0].ids
        return self.backend.encode(text, add_special_tokens=bool(add_special_tokens)).ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token's text has (vocabulary and added tokens; made once):
        a text of ``n`` characters is at least ``n / (2 * max_token_chars)`` tokens
        (:func:`~hybridkv.tokenizer.prompts.min_tokens`)."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(check_ids(ids, self.vocab_size), skip_special_tokens=bool(skip_special_tokens))
        return _clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in check_ids(ids, self.vocab_size)]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt, self.special_tokens, **kwargs)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids})"


def load_tokenizer(model_dir: str | Path) -> HFTokenizer:
    """The tokenizer of a model directory (or of the directory of a file in it, e.g. its config.json)."""
    from tokenizers import AddedToken, Tokenizer

    directory = Path(model_dir)
    if directory.is_file():
        directory = directory.parent
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"no tokenizer.json in {directory}")
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as e:
        raise TokenizerError(f"{path} is not a tokenizers file: {' '.join(str(e).split())}") from None
    config = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
    special = {name: _token_text(config.get(name)) for name in SPECIAL_NAMES}
    added = config.get("added_tokens_decoder") or {}
    new = [_added_token(AddedToken, t) for _, t in sorted(added.items(), key=lambda kv: int(kv[0]))]
    present_text = {t.content for t in backend.get_added_tokens_decoder().values()}
    new = [t for t in new if t is not None and t.content not in present_text]
    new += [AddedToken(t, special=True, normalized=False) for t in special.values() if t and t not in present_text]
    if new:
        backend.add_tokens(new)
    if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
        backend.post_processor = template_processor(backend, {**config, **special})
    return HFTokenizer(
        backend,
        special_tokens=special,
        chat_template=_chat_template(directory, config),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def template_processor(backend: Any, config: Mapping[str, Any]) -> Any:
    """transformers' ``update_post_processor``: ``bos $A eos`` as ``config``'s ``add_bos_token`` /
    ``add_eos_token`` say (``bos_token`` / ``eos_token`` name them; one the vocabulary lacks is left out)."""
    from tokenizers import processors

    bos = config.get("bos_token") if config.get("add_bos_token") else None
    eos = config.get("eos_token") if config.get("add_eos_token") else None
    bos, eos = (t if isinstance(t, str) and backend.token_to_id(t) is not None else None for t in (bos, eos))
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _added_token(cls: Any, spec: Any) -> Any:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
        return None
    keys = ("single_word", "lstrip", "rstrip", "normalized", "special")
    return cls(spec["content"], **{k: bool(spec[k]) for k in keys if k in spec})


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (WordPiece-era spacing before punctuation)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
