"""Bundled model configs, and reading a Hugging Face ``config.json`` from disk.

Each preset in ``presets/*.json`` holds the attention-relevant fields of a public
Hugging Face ``config.json``, copied as published (nothing derived or renamed):

==================  ================================  ========================================
preset              Hugging Face repository           layout
==================  ================================  ========================================
llama4-scout        meta-llama/Llama-4-Scout-17B-16E  36 chunked (8192) + 12 NoPE full
gemma-3-27b         google/gemma-3-27b-it             52 sliding (1024) + 10 full
mistral-7b          mistralai/Mistral-7B-v0.1         32 sliding (4096)
gpt-oss-20b         openai/gpt-oss-20b                12 sliding (128) + 12 full, alternating
llama-3.1-8b        meta-llama/Llama-3.1-8B           32 full
qwen3-next-80b-a3b  Qwen/Qwen3-Next-80B-A3B-Instruct  36 Gated DeltaNet + 12 full (every 4th)
qwen3.5-35b-a3b     Qwen/Qwen3.5-35B-A3B              30 Gated DeltaNet (fp32 state) + 10 full
==================  ================================  ========================================

Provenance of the two state-model presets (no copy of the repositories' own files was
reachable from here): every field is the published value as transcribed in several
public projects that quote the release's config.json (Qwen3-Next: the field list shared
by the -Instruct, -Thinking and Coder-Next releases; it states ``full_attention_interval``
and no ``layer_types``; Qwen3.5-35B-A3B: its ``text_config`` with ``layer_types`` and
``mamba_ssm_dtype: float32``), and agrees with transformers 5.24's ``Qwen3NextConfig`` /
``Qwen3_5MoeTextConfig`` defaults, whose docstrings name these checkpoints.

:func:`load_model_config` takes a preset name, a Hugging Face repository id of a
preset, a path to a ``config.json``, or a directory that contains one; an installed
model's name (``gemma-3-270m``) or a ``.gguf`` file gets the config
:mod:`hybridkv.checkpoint` builds from its metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.errors import InvalidConfigError

__all__ = ["Preset", "PRESETS", "preset_names", "find_preset", "load_model_config", "ModelSource"]


@dataclass(frozen=True, slots=True)
class Preset:
    """A bundled config: its short name, the repository it was copied from, aliases."""

    name: str
    hf_repo: str
    aliases: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return f"{self.name}.json"


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama4-scout", "meta-llama/Llama-4-Scout-17B-16E", ("llama-4-scout", "llama-4-scout-17b-16e")),
        Preset("gemma-3-27b", "google/gemma-3-27b-it", ("gemma3-27b", "gemma-3-27b-it")),
        Preset("mistral-7b", "mistralai/Mistral-7B-v0.1", ("mistral-7b-v0.1",)),
        Preset("gpt-oss-20b", "openai/gpt-oss-20b", ()),
        Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", ("llama3.1-8b", "llama-3.1-8b-instruct")),
        Preset("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct",
               ("qwen3-next-80b", "qwen3-next", "qwen3-next-80b-a3b-instruct")),
        Preset("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B", ("qwen3.5-35b", "qwen3_5-35b-a3b")),
    )
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A loaded config and where it came from (``label`` names it in messages)."""

    config: dict[str, Any]
    label: str
    preset: Preset | None = None


def preset_names() -> list[str]:
    """The short names of the bundled presets, in table order."""
    return list(PRESETS)


def find_preset(name: str) -> Preset | None:
    """The preset called ``name`` (short name, alias or repository id, any case), else None."""
    key = name.strip().lower()
    for preset in PRESETS.values():
        if key == preset.name or key in preset.aliases or key == preset.hf_repo.lower():
            return preset
    return None


def _parse_json(text: str, label: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidConfigError(f"{label}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise InvalidConfigError(f"{label}: JSON nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise InvalidConfigError(f"{label}: a config.json must hold a JSON object, got {type(data).__name__}")
    return data


def _load_preset(preset: Preset) -> ModelSource:
    folder = resources.files("hybridkv.planner").joinpath("presets")
    text = folder.joinpath(preset.filename).read_text(encoding="utf-8")
    return ModelSource(_parse_json(text, f"preset {preset.name}"), f"preset {preset.name}", preset)


def load_model_config(source: str | Path) -> ModelSource:
    """Read a config: a preset name first, else an installed model or a GGUF file, else a
    ``config.json`` or ``<dir>/config.json``.

    Raises :class:`InvalidConfigError` naming the path when it is missing, unreadable or
    not a JSON object; a missing name lists the presets.
    """
    if isinstance(source, str):
        preset = find_preset(source)
        if preset is not None:
            return _load_preset(preset)
    from hybridkv.checkpoint import INSTALLED_MODELS, looks_like_gguf, read_model_config, resolve_model

    path = Path(source)
    if (isinstance(source, str) and source.strip().lower() in INSTALLED_MODELS) or (
        path.is_file() and looks_like_gguf(path)
    ):
        checkpoint = resolve_model(source)
        return ModelSource(read_model_config(checkpoint), checkpoint.config_label)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise InvalidConfigError(
            f"{str(source)!r} is neither a config.json file nor a preset; presets: {', '.join(PRESETS)}; "
            f"or a .gguf file, or an installed model: {', '.join(INSTALLED_MODELS)}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidConfigError(f"{path}: cannot read config ({reason})") from None
    return ModelSource(_parse_json(text, str(path)), str(path))
