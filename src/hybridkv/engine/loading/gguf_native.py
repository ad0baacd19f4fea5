"""Loading a GGUF checkpoint with its quantized matrices kept as the file stores them
(``quantization="gguf"``, what ``--quantization auto`` picks on a CPU).

Which matrices: every *slot* the model multiplies by (a linear's weight; a fused q / k / v or
gate / up matrix, joined by rows from its parts: ``quant_parts()`` on the fusing module) whose
tensors are all in a block type the kernels read (:data:`~hybridkv.engine.layers.gguf_linear.BLOCK_TYPES`)
with whole blocks a row, and the embedding (a tied output projection shares it). Their bytes
are read once from the file (llama's q / k rows put back in HF's order, as for the dequantized
load: :func:`~hybridkv.engine.loading.gguf_weights.unpermute_rows`) and held as
:class:`~hybridkv.engine.layers.gguf_linear.GGUFWeight`; they are never dequantized whole. Every
other tensor (norms, F32 / F16 matrices, a slot with a part in another type) loads dequantized
as on the ``none`` path, through the same strict :func:`~hybridkv.engine.loading.weights.load_weights`
(every tensor used, every parameter found). No cache file is written: the blocks are the
final form.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hybridkv.checkpoint.gguf_file import GGUFFile, GGUFTensorInfo
from hybridkv.engine.layers.gguf_linear import GGUFWeight, block_type
from hybridkv.engine.layers.linear import Linear
from hybridkv.engine.loading.gguf_weights import (check_quant_types, gguf_tensors, gguf_weight_plan, permuted_heads,
                                                  unpermute_rows)
from hybridkv.engine.loading.weights import load_weights, progress

__all__ = ["EMBEDDING", "native_slots", "load_native"]

#: the embedding's parameter name
EMBEDDING = "model.embed_tokens.weight"


def native_slots(model) -> list[tuple[torch.nn.Module, str, list[str]]]:
    """``(module, attribute, parameter names in row order)`` of every weight slot of the unfused
    ``model``: each fusing module's slots (``quant_parts()``), then every other linear (a tied
    output projection left out: it shares the embedding)."""
    slots, grouped = [], set()
    for path, m in model.named_modules():
        parts = getattr(m, "quant_parts", None)
        if m is model or not callable(parts):
            continue
        prefix = f"{path}." if path else ""
        for attr, names in parts().items():
            grouped.update(id(getattr(m, n)) for n in names)
            slots.append((m, attr, [f"{prefix}{n}.weight" for n in names]))
    tied = model.tie_word_embeddings
    for path, m in model.named_modules():
        if isinstance(m, Linear) and id(m) not in grouped and not (tied and m is model.lm_head):
            slots.append((m, "packed", [f"{path}.weight"]))
    return slots


def _native_info(infos: Mapping[str, GGUFTensorInfo], name: str) -> GGUFTensorInfo | None:
    info = infos.get(name)
    if info is None or len(info.shape) != 2 or block_type(info.type_name, info.shape[1]) is None:
        return None
    return info


def _weight(gguf: GGUFFile, info: GGUFTensorInfo, config: Mapping[str, Any]) -> GGUFWeight:
    """One tensor's blocks, rows in HF's order, copied out of the mapping."""
    import numpy as np

    raw = gguf.raw(info)  # uint8 [rows, row bytes], memory-mapped
    heads = permuted_heads(gguf.architecture or "", info.name, config)
    if heads is not None:
        raw = unpermute_rows(raw, heads)
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, order="C", copy=True))
    return GGUFWeight([(info.ggml_type, data)], info.shape[1])


def _set_param(model, name: str, tensor: torch.Tensor) -> None:
    """Parameter ``name`` of ``model`` replaced by ``tensor`` (a tied output projection with the
    embedding: they stay one parameter)."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    param = torch.nn.Parameter(tensor, requires_grad=False)
    if name == EMBEDDING and model.tie_word_embeddings and model.lm_head.weight is module.weight:
        model.lm_head.weight = param
    setattr(module, attr, param)


def load_native(model, path, config: Mapping[str, Any], label: str, tied: dict[str, str], rename=None) -> int:
    """Fill the freshly built (unfused) ``model`` from GGUF file ``path``: native slots and
    embedding as :class:`GGUFWeight`, the rest dequantized; fuse; mark the model
    ``quantization = "gguf"``. Returns how many slots run natively."""
    gguf = GGUFFile.open(path)
    check_quant_types(gguf)
    infos = {name: info for name, _, info in gguf_weight_plan(gguf)}
    slots = native_slots(model)
    native: dict[str, GGUFTensorInfo] = {}
    chosen = []
    for m, attr, names in slots:
        found = [_native_info(infos, n) for n in names]
        if all(found):
            native.update(zip(names, found))
            chosen.append((m, attr, names))
    embed = _native_info(infos, EMBEDDING)
    if embed is not None:
        native[EMBEDDING] = embed
    params = model.state_dict(keep_vars=True)
    dtypes = {name: params[name].dtype for name in native}
    for name in native:  # no memory for what stays in blocks (fusing then joins empty matrices)
        _set_param(model, name, torch.empty(0, dtype=dtypes[name]))
    tensors = progress(gguf_tensors(gguf, config, skip=frozenset(native)), f"loading {label}")
    load_weights(model, tensors, label=str(path), tied=tied, rename=rename, provided=frozenset(native))
    model.fuse_weights()
    weights = {name: _weight(gguf, info, config) for name, info in native.items()}
    for m, attr, names in chosen:
        parts = [weights[n] for n in names]
        setattr(m, attr, parts[0] if len(parts) == 1 else GGUFWeight.cat(parts))
    if embed is not None:
        model.embed_quant = weights[EMBEDDING]
        model.embed_dtype = dtypes[EMBEDDING]
        if model.tie_word_embeddings:
            model.lm_head.packed = model.embed_quant
    model.quantization = "gguf"
    return len(chosen)
