"""The installed GGUF checkpoints run as stored (``quantization="gguf"``, what ``auto`` picks on
a CPU): every weight slot holds the file's own blocks and dequantizes to exactly the ``none``
path's fp32 weight (SmolLM2's llama q / k rows put back in HF's order; Gemma 3's fused q / k / v
of Q5_0 and Q8_0 parts); nothing full-size is dequantized or cached; greedy tokens follow the
``none`` path's (the two differ only in the order of fp32 sums); ``auto`` resolves as
documented."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.layers.gguf_linear import GGUFWeight
from hybridkv.engine.loading.gguf_native import native_slots
from hybridkv.engine.models import load_model, resolve_quantization
from hybridkv.errors import InvalidConfigError
from hybridkv.scheduler import SamplingParams

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(cpu_ops.load() is None, reason=f"cpu kernels unavailable: {cpu_ops.unavailable()}")]


def _slot_weight(model, names) -> torch.Tensor:
    """The exact model's fp32 weight of a slot (its parts joined by rows)."""
    params = model.state_dict()
    return torch.cat([params[n] for n in names])


def _check_slots(native, exact) -> set[str]:
    """Every slot of ``native`` is the file's blocks, equal to ``exact``'s weights; the types seen."""
    seen = set()
    exact_slots = {tuple(names): (m, a) for m, a, names in native_slots(exact)}
    slots = [(path, m) for path, m in native.named_modules()]
    assert native.quantization == "gguf" and native.fused_decode is not None
    count = 0
    for _, m in slots:
        for attr in ("packed", "qkv_packed", "gate_up_packed"):
            w = getattr(m, attr, None)
            if isinstance(w, GGUFWeight) and not (m is native.lm_head and native.tie_word_embeddings):
                count += 1
                seen.update(w.type_names)
    assert count == len(exact_slots)
    for names, (m, attr) in exact_slots.items():
        # the same module path in the native model
        path = names[0].rsplit(".", 2)[0] if attr != "packed" else names[0].rsplit(".", 1)[0]
        w = getattr(native.get_submodule(path), attr)
        assert isinstance(w, GGUFWeight), names
        assert torch.equal(w.dequantize(), _slot_weight(exact, names)), names
    embed = native.embed_quant
    assert isinstance(embed, GGUFWeight)
    assert torch.equal(embed.dequantize(), exact.model.embed_tokens.weight)
    if native.tie_word_embeddings:
        assert native.lm_head.packed is embed
    assert native.model.embed_tokens.weight.numel() == 0  # no full-size copy kept
    return seen | set(embed.type_names)


def test_smollm_slots_are_the_files_blocks(smollm_gguf, our_smollm, real_cache):
    before = set(real_cache.iterdir())
    native = load_model(smollm_gguf, quantization="gguf")
    assert set(real_cache.iterdir()) - before <= {real_cache / "cpu_ops"}  # no weight cache written
    assert _check_slots(native, our_smollm) == {"Q4_1", "Q8_0"}


@pytest.mark.slow
def test_gemma_slots_are_the_files_blocks(gemma_gguf, our_gemma):
    native = load_model(gemma_gguf, quantization="auto")
    assert native.quantization == "gguf"
    assert _check_slots(native, our_gemma) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    qkv = native.model.layers[0].self_attn.qkv_packed
    assert qkv.type_names == ("Q5_0", "Q5_0", "Q8_0")


def _greedy(model, prompts, new=16):
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=256, max_num_seqs=4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    return [list(o.output_token_ids) for o in outs]


def test_smollm_greedy_follows_the_exact_path(smollm_gguf, our_smollm):
    """Batched decode (the fused C step) and a prefill over KERNEL_ROWS rows (dequantized slices):
    the tokens of the ``none`` path, up to a late flip of a near tie (fp32 sums in another order)."""
    native = load_model(smollm_gguf, quantization="gguf")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 40, 90)]
    for a, b in zip(_greedy(native, prompts), _greedy(our_smollm, prompts)):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert same >= 8, (a, b)


def test_auto_resolves_as_documented(smollm_gguf, tmp_path):
    assert resolve_quantization("auto", smollm_gguf) == "gguf"
    assert resolve_quantization("auto", smollm_gguf, dtype="bfloat16") is None
    assert resolve_quantization("auto", smollm_gguf, device="cuda") is None
    assert resolve_quantization("none", smollm_gguf) is None and resolve_quantization(None, smollm_gguf) is None
    assert resolve_quantization("int8", smollm_gguf) == "int8"
    assert resolve_quantization("auto", tmp_path / "missing") is None  # the load reports it
    (tmp_path / "config.json").write_text("{}")
    assert resolve_quantization("auto", tmp_path) is None  # a model directory: safetensors
    with pytest.raises(InvalidConfigError, match="not a GGUF"):
        resolve_quantization("gguf", tmp_path)
    with pytest.raises(InvalidConfigError, match="quantization must be one of"):
        EngineConfig(quantization="q4")
