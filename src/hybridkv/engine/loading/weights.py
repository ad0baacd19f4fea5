"""Tensor sources and the one strict consumer, :func:`load_weights`.

A tensor source yields ``(name, tensor)`` pairs by the checkpoint's HF names: a model
directory's safetensors (:func:`safetensors_tensors`), a GGUF file's dequantized and
renamed tensors (:mod:`~hybridkv.engine.loading.gguf_weights`), or their disk cache.
Also here: a directory's ``config.json`` and its EOS ids.

Weights are matched to a module's ``state_dict()`` by their HF names. Every tensor
of the checkpoint must be used and every parameter must be found; anything else is
a :class:`~hybridkv.errors.WeightLoadError` that lists the names. The only allowed
gap is ``lm_head.weight`` when the config ties it to the input embedding.

A multimodal checkpoint (``Gemma3ForConditionalGeneration``, ``Llama4ForConditionalGeneration``)
is loaded through :func:`language_model_weight_name`: its language model's tensors by
their text-model names, the vision tower and projector skipped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping

import torch

from hybridkv.checkpoint.installed import ModelSource
from hybridkv.checkpoint.model_dir import checkpoint_files, read_config_json
from hybridkv.errors import InvalidConfigError, WeightLoadError

__all__ = [
    "read_config",
    "eos_token_ids",
    "checkpoint_files",
    "language_model_weight_name",
    "safetensors_tensors",
    "checkpoint_tensors",
    "load_weights",
    "NamedTensors",
]

#: what a tensor source yields: (the checkpoint's name for it, the tensor)
NamedTensors = Iterable[tuple[str, torch.Tensor]]

_MAX_LISTED = 12


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``model_dir`` (see :func:`hybridkv.checkpoint.read_config_json`)."""
    return read_config_json(model_dir)


def _token_ids(value: Any, where: str) -> list[int]:
    """An ``eos_token_id`` value (null, an int or a list of ints) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise InvalidConfigError(f"{where}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
    return values


def eos_token_ids(config: dict[str, Any], model_dir: str | Path | None = None) -> tuple[int, ...]:
    """The model's end-of-sequence ids: ``config.json``'s ``eos_token_id`` (an int, a list or
    null), then those of ``generation_config.json`` in ``model_dir`` if there is one (the
    ids HF ``generate`` stops at; vLLM stops at both too), without repeats."""
    ids = _token_ids(config.get("eos_token_id"), "config.json")
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            generation = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise InvalidConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(generation, dict):
            raise InvalidConfigError(f"{path}: expected a JSON object")
        ids += _token_ids(generation.get("eos_token_id"), "generation_config.json")
    return tuple(dict.fromkeys(ids))


#: where multimodal checkpoints keep the language model -> the text model's names. transformers
#: 5.24 writes (and Llama-4-Scout / gemma-3-4b-it ship) ``language_model.model.layers.0...`` and
#: ``language_model.lm_head.weight``; checkpoints saved by 4.52 - 4.57 have
#: ``model.language_model.layers.0...`` and ``lm_head.weight`` (already the text name)
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
#: the vision tower and the projector, in both layouts: not loaded
_VISION_PREFIXES = tuple(
    f"{outer}{part}."
    for outer in ("", "model.")
    for part in ("vision_tower", "vision_model", "multi_modal_projector", "visual")  # visual: Qwen3.5
)


def language_model_weight_name(name: str) -> str | None:
    """The text model's name of a multimodal checkpoint's tensor ``name``; None for vision / projector ones.

    >>> language_model_weight_name("language_model.model.layers.0.self_attn.q_proj.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> language_model_weight_name("model.language_model.norm.weight"), language_model_weight_name("lm_head.weight")
    ('model.norm.weight', 'lm_head.weight')
    >>> language_model_weight_name("model.vision_tower.encoder.layers.0.mlp.fc1.bias") is None
    True

    Any other name is kept (and reported as unknown if the model has no such tensor).
    """
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    if name.startswith(_VISION_PREFIXES):
        return None
    return name


def progress(items: Iterable, desc: str, total: int | None = None) -> Iterable:
    """``items`` with a progress bar on stderr when it is a terminal (tqdm), else as they are
    (piped output stays clean; ``HYBRIDKV_PROGRESS=0`` turns the bar off)."""
    if os.environ.get("HYBRIDKV_PROGRESS", "1") == "0" or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    return tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    if len(names) > _MAX_LISTED:
        shown += f", ... ({len(names) - _MAX_LISTED} more)"
    return shown


def safetensors_tensors(
    model_dir: str | Path, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``model_dir``'s safetensors files, by their stored names (``skip(name)``:
    not read at all, e.g. a multimodal checkpoint's vision tower)."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise WeightLoadError(f"cannot read {path}: {exc}") from None
        with handle as f:
            for stored in f.keys():
                if skip is None or not skip(stored):
                    yield stored, f.get_tensor(stored)


def checkpoint_tensors(
    source: ModelSource, config: Mapping[str, Any], skip: Callable[[str], bool] | None = None,
    use_cache: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensor source of ``source``: its safetensors, or its GGUF file's tensors converted to HF's
    names and layouts (through the fp32 disk cache unless ``use_cache`` is off, see
    :mod:`~hybridkv.engine.loading.weight_cache`). A progress bar on a terminal."""
    if source.kind == "dir":
        yield from progress(safetensors_tensors(source.path, skip), f"loading {source.path.name}")
        return
    from hybridkv.checkpoint.gguf_file import GGUFFile
    from hybridkv.engine.loading import gguf_weights, weight_cache

    gguf = GGUFFile.open(source.path)
    gguf_weights.check_quant_types(gguf)  # before the cache is consulted: the file decides
    plan = [(name, shape) for name, shape, _ in gguf_weights.gguf_weight_plan(gguf)]
    label = f"loading {source.name or source.path.name}"
    folder = weight_cache.cache_dir()
    if folder is None or not use_cache:
        yield from progress(gguf_weights.gguf_tensors(gguf, config), label, len(plan))
        return
    sha256 = source.sha256 or weight_cache.file_sha256(source.path, folder)
    tensors = weight_cache.cached_tensors(sha256, plan, lambda: gguf_weights.gguf_tensors(gguf, config), folder)
    yield from progress(tensors, label, len(plan))


def load_weights(
    module: torch.nn.Module,
    tensors: NamedTensors,
    label: str,
    tied: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
    rename: Callable[[str], str | None] | None = None,
    provided: Collection[str] = (),
) -> None:
    """Copy ``tensors`` (a tensor source: safetensors, GGUF, a cache) into ``module``'s parameters by name.

    ``tied`` maps a parameter that may be absent to the one it shares storage with
    (``{"lm_head.weight": "model.embed_tokens.weight"}``); the module must already
    tie them. ``rename`` maps a checkpoint name to the parameter's (None: skip the
    tensor). ``provided``: parameters another route fills (a GGUF file's blocks kept as they are),
    counted as found and not expected among ``tensors``. Raises WeightLoadError for unknown, missing, misshaped or repeated tensors
    (messages name the checkpoint's tensors as the source does, prefixed by ``label``).
    """
    tied = tied or {}
    params = module.state_dict(keep_vars=True)
    seen: set[str] = set(provided)
    unknown: list[str] = []
    misshaped: list[str] = []
    repeated: list[str] = []
    for stored, tensor in tensors:
        name = rename(stored) if rename is not None else stored
        if name is None:
            continue
        target = params.get(name)
        if target is None:
            unknown.append(stored)
            continue
        if name in seen:  # two layouts of one tensor in one checkpoint
            repeated.append(stored)
            continue
        if tuple(tensor.shape) != tuple(target.shape):
            misshaped.append(f"{stored} {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            continue
        with torch.no_grad():
            target.data.copy_(tensor.to(dtype or target.dtype))
        seen.add(name)
    missing = [n for n in params if n not in seen and not (n in tied and tied[n] in seen)]
    problems = []
    if unknown:
        problems.append(f"unknown tensors: {_listing(unknown)}")
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if misshaped:
        problems.append(f"misshaped tensors: {_listing(misshaped)}")
    if repeated:
        problems.append(f"tensors stored twice: {_listing(repeated)}")
    if problems:
        raise WeightLoadError(f"{label}: " + "; ".join(problems))
