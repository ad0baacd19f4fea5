"""The parts of a ``tokenizers`` tokenizer, from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary under llama.cpp's keys
(``tokenizer.ggml.model``, ``.tokens``, ``.scores``, ``.token_type``, ``.merges``, the special
ids, ``.add_bos_token``). This module rebuilds what transformers 5.24 builds from the same keys
(``integrations/gguf/gguf_tokenizer_mapping.py``), so encoding matches
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` id for id:

- ``gpt2``: byte-level BPE with the file's merges (SmolLM2; ``tokenizer.ggml.pre`` picks the
  split regex for the few families transformers knows, else GPT-2's ByteLevel split).
- ``llama``: SentencePiece-style BPE with byte fallback. Gemma files list no merges; they are
  derived from the vocabulary (every split of a token into two vocabulary pieces), ranked by
  the token's position in the file (Gemma's scores do not follow its merge order). Gemma
  also stores tokens of 2+ spaces as real spaces, respelled with ``▁`` here.

Token types: 3 (control) become special added tokens, 4 (user-defined) plain added tokens;
1 (normal), 2 (unknown), 5 (unused) and 6 (byte) stay in the model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from hybridkv.errors import TokenizerError

CONTROL, USER_DEFINED = 3, 4
#: ``general.architecture`` values whose SentencePiece vocabulary gets Gemma's treatment
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
SUPPORTED_MODELS = ("gpt2", "llama")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``tokenizer.ggml.pre`` -> the split regex its merges were learned with (transformers' table, in part)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (``0x20`` -> ``Ġ``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(spelling.items()))


class TokenizerParts(NamedTuple):
    """What a GGUF's metadata says, in ``tokenizers``' terms.

    ``skeleton`` is a ``tokenizer.json`` dict whose BPE model is still empty (``model_args`` are
    its arguments besides ``vocab`` and ``merges``); ``added`` lists ``(content, special)``;
    ``config`` holds what a ``tokenizer_config.json`` would: ``bos_token``, ``eos_token``,
    ``unk_token``, ``pad_token`` (strings or None), ``add_bos_token``, ``add_eos_token``,
    ``chat_template`` and ``extra_eos_ids`` (``eot``/``eom`` ids).
    """

    skeleton: dict
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    model_args: dict[str, Any]
    added: list[tuple[str, bool]]
    config: dict[str, Any]


def tokenizer_parts_from_gguf(metadata: Mapping[str, Any]) -> TokenizerParts:
    """The tokenizer this metadata describes (``TokenizerError`` if it cannot be built)."""
    kind = metadata.get("tokenizer.ggml.model")
    original = _list_of(metadata, "tokenizer.ggml.tokens", str)
    types = _optional_list(metadata, "tokenizer.ggml.token_type", int, len(original))
    architecture = str(metadata.get("general.architecture", ""))
    tokens = original
    if kind == "gpt2":
        vocab, merges = _byte_level_vocab(tokens), _file_merges(metadata)
    elif kind == "llama":
        if architecture in GEMMA_ARCHITECTURES:
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {token: index for index, token in enumerate(tokens)}
        if "tokenizer.ggml.merges" in metadata:
            merges = _file_merges(metadata)
        elif architecture in GEMMA_ARCHITECTURES:
            merges = _merges_by_position(vocab)
        else:
            scores = _optional_list(metadata, "tokenizer.ggml.scores", float, len(tokens))
            if scores is None:
                raise TokenizerError("GGUF tokenizer 'llama' has neither merges nor scores (tokenizer.ggml.scores)")
            merges = generate_merges(vocab, dict(zip(tokens, scores)))
    else:
        raise TokenizerError(
            f"cannot build a tokenizer from GGUF tokenizer.ggml.model={kind!r}; supported: {', '.join(SUPPORTED_MODELS)}"
        )
    config = gguf_config(metadata)
    skeleton = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,  # set by hf.template_processor once the vocabulary is in
        "decoder": None,
    }
    if kind == "gpt2":
        skeleton.update(_byte_level_parts(str(metadata.get("tokenizer.ggml.pre", ""))))
        model_args = _bpe_args(unk=None, byte_fallback=False, fuse_unk=False, affixes="")
    else:
        skeleton.update(_sentencepiece_parts(architecture))
        unk = config["unk_token"] if architecture in GEMMA_ARCHITECTURES else None
        model_args = _bpe_args(unk=unk, byte_fallback=True, fuse_unk=True, affixes=None)
    skeleton["model"] = {"type": "BPE", **model_args, "vocab": {}, "merges": []}
    added = _added_tokens(original, types, vocab, config, byte_level=kind == "gpt2")
    return TokenizerParts(skeleton, vocab, merges, model_args, added, config)


def generate_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary, best first: transformers' ``generate_merges`` with scores.

    Every token splits into each pair of vocabulary pieces that spell it; pairs are ranked by
    the token's score (higher first), then by the longer left piece. Worked example: vocab
    ``{a:0, b:1, c:2, ab:3, bc:4, abc:5}``, scores ``ab:-1, bc:-2, abc:-3`` (others -9) gives
    ``[(a,b), (b,c), (ab,c), (a,bc)]``: ``abc``'s two splits come last, longer left first.
    """
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _merges_by_position(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """``generate_merges(vocab, {token: -position})`` without the sorts (Gemma: 262,144 tokens).

    With the score ``-position`` a token's rank is its (last) position in the file, and within one
    token the global sort's tie-break (longer left piece first) decides; a stable reverse sort keeps
    nothing else. So: tokens in order of their last position, splits from the longest left piece.
    """
    merges: list[tuple[str, str]] = []
    append = merges.append
    known = vocab.__contains__
    for token in sorted(vocab, key=vocab.__getitem__):
        for i in range(len(token) - 1, 0, -1):
            if known(token[:i]) and known(token[i:]):
                append((token[:i], token[i:]))
    return merges


def _file_merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for merge in _list_of(metadata, "tokenizer.ggml.merges", str):
        pair = tuple(merge.split(" "))
        if len(pair) != 2:
            raise TokenizerError(f"GGUF merge {merge!r} is not two pieces separated by one space")
        merges.append(pair)
    return merges


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    return {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }


def gguf_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What a ``tokenizer_config.json`` would hold (see ``TokenizerParts.config``); cheap."""
    tokens = _list_of(metadata, "tokenizer.ggml.tokens", str)
    kind = metadata.get("tokenizer.ggml.model")
    config: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < len(tokens)):
            raise TokenizerError(f"GGUF tokenizer.ggml.{key}_token_id={token_id!r} is outside the {len(tokens)} tokens")
        config[name] = tokens[token_id] if token_id is not None else None
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    config["add_bos_token"] = bool(add_bos) if add_bos is not None else kind == "llama"  # llama.cpp's default
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    template = metadata.get("tokenizer.chat_template")
    config["chat_template"] = template if isinstance(template, str) else None
    extra_eos = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
    config["extra_eos_ids"] = [i for i in extra_eos if isinstance(i, int) and 0 <= i < len(tokens)]
    return config


def _added_tokens(tokens, types, vocab, config, byte_level: bool) -> list[tuple[str, bool]]:
    """Control tokens as special added tokens, user-defined ones as plain added tokens, then the
    named special tokens (bos/eos/unk/pad) if not already there (transformers' order and rules:
    a control token outside the byte alphabet of a byte-level vocabulary is a mislabel, skipped)."""
    spelled = set(bytes_to_unicode().values()) if byte_level else None
    added: dict[str, bool] = {}
    for token, kind in zip(tokens, types or ()):
        if kind == CONTROL and (spelled is None or set(token) <= spelled) and token in vocab:
            added.setdefault(token, True)
    for token, kind in zip(tokens, types or ()):
        if kind == USER_DEFINED and token in vocab:
            added.setdefault(token, False)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if config[name] is not None and config[name] in vocab:
            added.setdefault(config[name], True)
    return list(added.items())


def _bpe_args(*, unk, byte_fallback: bool, fuse_unk: bool, affixes) -> dict[str, Any]:
    return {
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": affixes,
        "end_of_word_suffix": affixes,
        "fuse_unk": fuse_unk,
        "byte_fallback": byte_fallback,
        "ignore_merges": False,
    }


def _byte_level_parts(pre: str) -> dict:
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        pre_tokenizer = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    else:
        pre_tokenizer = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }
    decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return {"pre_tokenizer": pre_tokenizer, "decoder": decoder}


def _sentencepiece_parts(architecture: str) -> dict:
    fallback = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]
    if architecture in GEMMA_ARCHITECTURES:  # GemmaTokenizer: spaces become ▁, no prefix space
        return {
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
            "decoder": {"type": "Sequence", "decoders": fallback},
        }
    # LlamaTokenizer (legacy=False, add_prefix_space=True): ▁ prepended to the first word, stripped on decode
    return {
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        "decoder": {"type": "Sequence", "decoders": [*fallback, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    }


def _list_of(metadata: Mapping[str, Any], key: str, kind: type) -> list:
    value = metadata.get(key)
    if not isinstance(value, list) or not value:
        raise TokenizerError(f"GGUF metadata has no {key} list")
    if kind is not str and not all(isinstance(v, (int, float)) for v in value[:64]):
        raise TokenizerError(f"GGUF metadata {key} is not a list of numbers")
    if kind is str and not all(isinstance(v, str) for v in value):
        raise TokenizerError(f"GGUF metadata {key} is not a list of strings")
    return value


def _optional_list(metadata: Mapping[str, Any], key: str, kind: type, length: int) -> list | None:
    if key not in metadata:
        return None
    value = _list_of(metadata, key, kind)
    if len(value) != length:
        raise TokenizerError(f"GGUF metadata {key} has {len(value)} entries for {length} tokens")
    return value
