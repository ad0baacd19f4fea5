"""A character-level ``tokenizer.json`` (+ ``tokenizer_config.json``) for the tiny test models.

Written with the ``tokenizers`` library: SentencePiece-style ``▁`` spaces (Metaspace), BOS
added to text, multi-byte characters as single tokens, special tokens, and a chat template.
It has exactly 128 ids, the tiny models' vocabulary, so every id a random model samples
has text.
"""

from __future__ import annotations

import json

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHARS = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'é世界") + list(
    "àâäçèêëîïôöùûüñαβγδεζηθικλμνξοπρστυφχψω"
) + [chr(c) for c in range(0x430, 0x450)]  # Cyrillic: enough to give every model id a character
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(path, template: str = TEMPLATE) -> None:
    """A 128-id character tokenizer (every model id has text) with BOS, EOS and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS[: 128 - len(SPECIALS)])}
    assert len(vocab) == 128
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": template,
    }))
