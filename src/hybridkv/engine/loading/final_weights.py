"""A loaded model's weights in their final form (bf16, int8, int4), cached on disk per GGUF file.

A GGUF model loads by dequantizing its tensors; in fp32 those are cached as they are
(:mod:`~hybridkv.engine.loading.weight_cache`). Any other form (``dtype`` bf16 / fp16, or
weight-only quantization) is cached once it is built, instead of the fp32 tensors:
``<cache>/gguf-<sha256>-final-v<FINAL_VERSION>-<dtype>-<quantization>[-<compute dtype>].safetensors``, the
model's own tensors (``p.<state_dict name>``; weights held quantized are left out) and its
quantized weights (``q.<module>.<attribute>.<field>``, the embedding's as
``q.embed_quant.<field>``), with the quantization and int4 group in the file's metadata.
The file is the size of the final form: half the fp32 tensors' in bf16, less again quantized.

A warm load builds the model empty and fills it from the file (memory-mapped); a file that
does not open or does not fit the model exactly is removed and rebuilt. Written to a
temporary name and renamed, so a reader sees a whole file or none.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hybridkv.engine.layers.quantized_linear import Int4Weight, Int8Weight
from hybridkv.engine.loading.quantize_weights import adopt_quantized_embedding, compute_dtype_here, quant_slots

__all__ = ["FINAL_VERSION", "final_cache_for", "final_cache_path", "save_final", "load_final"]

#: bump when the final form changes (quantization rules, names)
FINAL_VERSION = 3

_KINDS = {"int8": Int8Weight, "int4": Int4Weight}


def final_cache_path(folder: Path, sha256: str, dtype: torch.dtype, quantization: str | None,
                     compute_dtype: torch.dtype | None = None) -> Path:
    """The file of a form: a quantized one is named with its compute dtype too (this CPU's rule by
    default), so a cache folder shared by CPUs with and without native bf16 keeps both."""
    name = str(dtype).replace("torch.", "")
    quant = quantization or "none"
    if quantization is not None:
        quant += "-" + str(compute_dtype or compute_dtype_here()).replace("torch.", "")
    return folder / f"gguf-{sha256}-final-v{FINAL_VERSION}-{name}-{quant}.safetensors"


def final_cache_for(source, dtype: torch.dtype, quantization: str | None) -> Path | None:
    """Where ``source`` (a ModelSource) in this form is cached; None: an fp32 or non-GGUF model, or the cache is off."""
    from hybridkv.engine.loading import weight_cache

    if source.kind != "gguf" or (dtype == torch.float32 and quantization is None) or quantization == "gguf":
        return None
    folder = weight_cache.cache_dir()
    if folder is None:
        return None
    sha256 = source.sha256 or weight_cache.file_sha256(source.path, folder)
    return final_cache_path(folder, sha256, dtype, quantization)


def final_tensors(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's tensors and metadata as :func:`load_final` restores them (copies: no shared storage)."""
    tensors: dict[str, torch.Tensor] = {}
    tied = model.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    for name, t in model.state_dict().items():
        if t.numel() and not (tied and name == "lm_head.weight"):
            tensors[f"p.{name}"] = t.detach().clone().contiguous()
    group = 0
    if model.quantization is not None:
        for path, m, attr, _ in quant_slots(model):
            for field, t in getattr(m, attr).to_tensors().items():
                tensors[f"q.{path}.{attr}.{field}"] = t.detach().clone().contiguous()
        for field, t in model.embed_quant.to_tensors().items():
            tensors[f"q.embed_quant.{field}"] = t.detach().clone().contiguous()
        group = getattr(model.embed_quant, "group", 0)
    meta = {"version": str(FINAL_VERSION), "quantization": model.quantization or "", "group": str(group)}
    return tensors, meta


def save_final(model, path: Path) -> None:
    """Write ``model``'s final form to ``path`` (best effort: a cache that cannot be written is skipped)."""
    from safetensors.torch import save_file

    tensors, meta = final_tensors(model)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        if tmp.exists():
            try:
                tmp.unlink()
            except OSError:
                pass


def load_final(model, path: Path, quantization: str | None) -> bool:
    """Fill the freshly built (empty, unfused) ``model`` from ``path``; False (and the file removed)
    when it does not open or does not fit."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("version") != str(FINAL_VERSION) or (meta.get("quantization") or None) != quantization:
                raise ValueError("another version or quantization")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        _restore(model, tensors, quantization, int(meta.get("group", "0")))
        return True
    except Exception:  # a damaged or foreign file: rebuild it
        try:
            path.unlink()
        except OSError:
            pass
        return False


def _restore(model, tensors: dict[str, torch.Tensor], quantization: str | None, group: int) -> None:
    params = model.state_dict(keep_vars=True)
    tied = model.tie_word_embeddings
    held = {name[2:] for name in tensors if name.startswith("p.")}
    with torch.no_grad():
        for name, target in params.items():
            if name in held:
                t = tensors[f"p.{name}"]
                if t.shape != target.shape or t.dtype != target.dtype:
                    raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}")
                target.data.copy_(t)
            elif quantization is None and not (tied and name == "lm_head.weight"):
                raise ValueError(f"{name} is missing")
    model.fuse_weights()
    if quantization is None:
        return
    kind = _KINDS[quantization]
    for path, m, attr, _ in quant_slots(model):
        prefix = f"q.{path}.{attr}."
        fields = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        setattr(m, attr, kind.from_tensors(fields, group))
    fields = {k[len("q.embed_quant."):]: v for k, v in tensors.items() if k.startswith("q.embed_quant.")}
    adopt_quantized_embedding(model, kind.from_tensors(fields, group), quantization)
