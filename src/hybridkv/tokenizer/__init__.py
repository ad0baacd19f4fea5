"""Text in, text out: tokenizers, incremental detokenization, stop strings, chat templates.

Torch-free. ``tokenizers`` and ``jinja2`` are imported lazily, inside the functions that need
them, so the byte-level tokenizer, the detokenizer and the stop matcher work without them.

Usage::

    from hybridkv.tokenizer import IncrementalDetokenizer, StopStringMatcher, tokenizer_from_gguf

    tok = tokenizer_from_gguf(metadata)               # or load_tokenizer(model_dir) / ByteTokenizer()
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    detok, stops = IncrementalDetokenizer(tok, prompt), StopStringMatcher(["\\n\\n"])
    for new_ids in steps:                             # per engine step
        text, stopped = stops.feed(detok.add(new_ids))
"""

from hybridkv.tokenizer.base import Tokenizer, check_vocab
from hybridkv.tokenizer.byte_tokenizer import ByteTokenizer
from hybridkv.tokenizer.chat import render_chat_template
from hybridkv.tokenizer.detokenizer import IncrementalDetokenizer
from hybridkv.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from hybridkv.tokenizer.hf import HFTokenizer, load_tokenizer
from hybridkv.tokenizer.stop import StopStringMatcher

__all__ = [
    "Tokenizer",
    "HFTokenizer",
    "ByteTokenizer",
    "load_tokenizer",
    "tokenizer_from_gguf",
    "check_vocab",
    "render_chat_template",
    "IncrementalDetokenizer",
    "StopStringMatcher",
]
