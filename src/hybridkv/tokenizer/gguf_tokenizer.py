"""``tokenizer_from_gguf``: a ``HFTokenizer`` built from GGUF metadata, cached on disk.

Building Gemma 3's tokenizer (262,144 tokens, ~515k merges derived from the vocabulary) costs a
few seconds; the built ``tokenizer.json`` is cached under ``$HYBRIDKV_CACHE_DIR/tokenizers`` (or
``~/.cache/hybridkv/tokenizers``), keyed by a hash of the tokenizer metadata, written atomically;
an entry that does not load is rebuilt. SmolLM2's (49,152 tokens, merges in the file) is built
directly.

Usage::

    tok = tokenizer_from_gguf(GGUFFile.open(path).metadata)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridkv.errors import TokenizerError
from hybridkv.tokenizer.gguf_vocab import TokenizerParts, tokenizer_parts_from_gguf
from hybridkv.tokenizer.hf import SPECIAL_NAMES, HFTokenizer, template_processor

#: bump when the built tokenizer changes for the same metadata (old cache entries are then ignored)
FORMAT_VERSION = 1
#: below this many tokens building is cheaper than reading a cached file
CACHE_MIN_TOKENS = 100_000


def tokenizer_from_gguf(metadata: Mapping[str, Any], *, cache: bool = True) -> HFTokenizer:
    """The tokenizer a GGUF file's metadata describes (``TokenizerError`` if it cannot be built)."""
    if not isinstance(metadata, Mapping):
        raise TokenizerError(f"GGUF metadata must be a mapping, got {type(metadata).__name__}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    path = None
    if cache and isinstance(tokens, list) and len(tokens) >= CACHE_MIN_TOKENS:
        path = cache_dir() / f"{metadata_hash(metadata)}.json"
        backend = _load_cached(path)
        if backend is not None:
            from hybridkv.tokenizer.gguf_vocab import gguf_config

            return _wrap(backend, gguf_config(metadata))
    parts = tokenizer_parts_from_gguf(metadata)
    backend = build_backend(parts)
    if path is not None:
        _store(path, backend.to_str())
    return _wrap(backend, parts.config)


def build_backend(parts: TokenizerParts) -> Any:
    """A ``tokenizers.Tokenizer`` from the parts (the big vocabulary goes in as Python objects, not JSON)."""
    from tokenizers import AddedToken, Tokenizer, models

    try:
        backend = Tokenizer.from_str(json.dumps(parts.skeleton))
        args = {k: v for k, v in parts.model_args.items() if v is not None}  # the constructor takes no None
        backend.model = models.BPE(vocab=parts.vocab, merges=parts.merges, **args)
    except Exception as e:
        raise TokenizerError(f"cannot build the GGUF tokenizer: {' '.join(str(e).split())}") from None
    special = [AddedToken(t, special=True, normalized=False) for t, s in parts.added if s]
    plain = [AddedToken(t, special=False, normalized=False) for t, s in parts.added if not s]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)
    backend.post_processor = template_processor(backend, parts.config)
    return backend


def cache_dir() -> Path:
    root = os.environ.get("HYBRIDKV_CACHE_DIR") or str(Path.home() / ".cache" / "hybridkv")
    return Path(root) / "tokenizers"


def metadata_hash(metadata: Mapping[str, Any]) -> str:
    """sha256 over the tokenizer keys (and the architecture, which picks Gemma's rules)."""
    h = hashlib.sha256(f"hybridkv-gguf-tokenizer-{FORMAT_VERSION}".encode())
    for key in sorted(k for k in metadata if k.startswith("tokenizer.") or k == "general.architecture"):
        h.update(json.dumps([key, metadata[key]], ensure_ascii=True, default=repr).encode())
    return h.hexdigest()[:32]


def _wrap(backend: Any, config: Mapping[str, Any]) -> HFTokenizer:
    return HFTokenizer(
        backend,
        special_tokens={name: config[name] for name in SPECIAL_NAMES},
        chat_template=config["chat_template"],
        extra_eos_ids=config["extra_eos_ids"],
    )


def _load_cached(path: Path) -> Any:
    from tokenizers import Tokenizer

    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # a torn or corrupt entry: rebuild it
        try:
            path.unlink()
        except OSError:
            pass
        return None


def _store(path: Path, text: str) -> None:
    """Atomic write (temp file + rename); a cache that cannot be written is skipped, not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
