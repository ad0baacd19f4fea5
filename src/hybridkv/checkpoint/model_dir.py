"""A model directory on disk: its ``config.json`` and its safetensors files (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.errors import InvalidConfigError, WeightLoadError

__all__ = ["read_config_json", "checkpoint_files"]


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``model_dir`` (InvalidConfigError if absent or not a JSON object)."""
    path = Path(model_dir) / "config.json"
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise InvalidConfigError(f"no config.json in {model_dir}") from None
    except json.JSONDecodeError as exc:
        raise InvalidConfigError(f"{path}: not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidConfigError(f"{path}: cannot read config ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidConfigError(f"{path}: expected a JSON object")
    return config


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``: the sharded index's files, or all ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightLoadError(f"{index}: malformed safetensors index ({exc})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise WeightLoadError(f"shards named by {index} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    return files
