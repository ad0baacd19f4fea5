"""GGUF weights on the torch side: tiny random HF models converted the way llama.cpp does
(permuted q/k, Gemma norms + 1, tied heads dropped, quantized through every type the gguf
package can write), loaded by us and by transformers from the same file: identical state,
identical greedy tokens and logits. Then bad files (unsupported types, stray or missing
tensors) and the dequantized-tensor disk cache."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch
from tests.support.engine_driver import Req, run_engine
from tests.support.gguf_tiny import QUANT_CYCLE, _permute, write_gguf, write_like_llama_cpp
from tests.support.hf_tiny import build_tiny, hf_generate
from tests.support.tiers import slow_except

from hybridkv.checkpoint import GGUFFile, ModelSource, resolve_model
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.models import CausalLM, Gemma3ForCausalLM, load_model
from hybridkv.engine.loading import gguf_weights, weight_cache
from hybridkv.engine.loading.gguf_weights import GGUF_LAYER_NAMES, unpermute_rows, hf_tensor_name
from hybridkv.errors import UnsupportedQuantizationError, WeightLoadError
from hybridkv.scheduler import SamplingParams

V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
TOL = 1e-4
NEW = 12


def _prompts():
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 128, (41,), generator=g).tolist()
    return {"A": base, "B": base[:30] + torch.randint(0, 128, (9,), generator=g).tolist(),
            "C": torch.randint(0, 128, (23,), generator=g).tolist()}


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """arch -> (gguf path, transformers' model from it, our model from it, HF refs per prompt)."""
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"gguf-{arch}")
            hf_original = build_tiny(arch, folder / "hf")
            path = write_like_llama_cpp(hf_original, arch, folder / "model.gguf", start=3 if arch == "gemma3" else 0)
            hf = AutoModelForCausalLM.from_pretrained(
                str(folder), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            ours = load_model(path)
            refs = {k: hf_generate(hf, p, NEW) for k, p in PROMPTS.items()}
            cache[arch] = (path, hf, ours, refs)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", slow_except(["llama", "gemma3"], 1))
def test_state_equals_transformers_loading_the_same_gguf(arch, converted):
    path, hf, ours, _ = converted(arch)
    mine, theirs = ours.state_dict(), hf.state_dict()
    assert set(mine) == set(theirs)
    for name, want in theirs.items():
        assert torch.equal(mine[name], want), name  # exact: same dequantization, same fp32 arithmetic
    types = {t.type_name for t in GGUFFile.open(path).tensors}
    assert {q.name for q in QUANT_CYCLE} <= types  # every writable type was read
    assert ours.source == ModelSource("gguf", path, str(path))
    tied = arch == "gemma3"
    assert ours.tie_word_embeddings is tied and (ours.lm_head.weight is ours.model.embed_tokens.weight) is tied


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tokens_and_logits_equal_transformers(arch, converted):
    _, _, ours, refs = converted(arch)
    reqs = [Req(k, PROMPTS[k], NEW) for k in "ABC"]
    result = run_engine(ours, reqs, block_size=8, num_blocks=64, prefill_chunk=7)
    for name, (tokens, logits) in refs.items():
        assert result.outputs[name] == tokens, name
        assert (result.logits[name] - logits).abs().max().item() < TOL, name


def test_llm_engine_runs_a_gguf_path(converted):
    path, _, _, refs = converted("gemma3")
    engine = LLMEngine(str(path), EngineConfig(block_size=4, num_blocks=200, max_num_seqs=3))  # loads the file
    outs = engine.generate([PROMPTS[k] for k in "ABC"], SamplingParams(max_tokens=NEW))
    assert [list(o.output_token_ids) for o in outs] == [refs[k][0] for k in "ABC"]
    engine.scheduler.check_invariants()
    assert isinstance(engine.model, Gemma3ForCausalLM) and engine.model.source.kind == "gguf"


def test_load_model_takes_str_path_and_model_source(converted):
    path, _, ours, _ = converted("llama")
    for source in (path, resolve_model(str(path))):
        again = load_model(source, prepack=False)
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    assert isinstance(CausalLM, type) and type(ours).from_pretrained(path, prepack=False).source.path == path


# ------------------------------------------------------------------ names and layouts
@pytest.mark.parametrize("arch", list(GGUF_LAYER_NAMES))
def test_name_tables_agree_with_the_gguf_package(arch):
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, 3)
    for gguf_short, hf in GGUF_LAYER_NAMES[arch].items():
        assert names.get_name(f"model.layers.2.{hf}") == f"blk.2.{gguf_short}", hf
        assert hf_tensor_name(arch, f"blk.2.{gguf_short}.bias") == f"model.layers.2.{hf}.bias"
    for hf in ("model.embed_tokens", "model.norm", "lm_head"):
        assert hf_tensor_name(arch, f"{names.get_name(hf)}.weight") == f"{hf}.weight"
    assert hf_tensor_name(arch, "blk.0.ffn_gate_exps.weight") == "blk.0.ffn_gate_exps.weight"  # reported unknown


def testunpermute_rows_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for _ in range(50):
        heads = int(rng.integers(1, 6))
        half = int(rng.integers(1, 5))
        cols = [] if rng.random() < 0.3 else [int(rng.integers(1, 7))]
        w = rng.standard_normal([heads * 2 * half, *cols]).astype(np.float32)
        assert np.array_equal(unpermute_rows(_permute(w, heads), heads), w)
        if half > 1:
            assert not np.array_equal(_permute(w, heads), w)


# ------------------------------------------------------------------ bad files
def _minimal_llama(path, extra_tensors=(), drop=(), eot=None):
    """A 1-layer llama GGUF (hidden 32, 2 heads, vocab 8), optionally with stray / missing tensors."""
    md = [("llama.block_count", 1, V.UINT32, None), ("llama.embedding_length", 32, V.UINT32, None),
          ("llama.feed_forward_length", 32, V.UINT32, None), ("llama.attention.head_count", 2, V.UINT32, None),
          ("llama.attention.head_count_kv", 2, V.UINT32, None), ("llama.context_length", 64, V.UINT32, None),
          ("llama.vocab_size", 8, V.UINT32, None), ("tokenizer.ggml.eos_token_id", 3, V.UINT32, None)]
    if eot is not None:
        md.append(("tokenizer.ggml.eot_token_id", eot, V.UINT32, None))
    rng = np.random.default_rng(1)
    shapes = {"token_embd.weight": (8, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
              "blk.0.ffn_norm.weight": (32,), **{f"blk.0.{n}.weight": (32, 32) for n in
              ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}}
    tensors = [(n, rng.standard_normal(s).astype(np.float32), None) for n, s in shapes.items() if n not in drop]
    return write_gguf(path, "llama", md, [*tensors, *extra_tensors])


def test_minimal_file_loads_with_eos_and_eot(tmp_path):
    model = load_model(_minimal_llama(tmp_path / "m.gguf", eot=5))
    assert model.eos_token_ids == (3, 5) and model.tie_word_embeddings


@pytest.mark.parametrize("qtype", [Q.Q8_K, Q.I32, Q.F64, Q.Q8_1])
def test_unsupported_type_fails_before_anything_loads(tmp_path, qtype, private_tensor_cache, monkeypatch):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((2, 256 // block * size), np.uint8)
    path = _minimal_llama(tmp_path / "m.gguf", extra_tensors=[("blk.0.odd.weight", raw, qtype)])
    monkeypatch.setattr(gguf_weights, "gguf_tensors", lambda *a: pytest.fail("tensors read before the check"))
    with pytest.raises(UnsupportedQuantizationError) as info:
        load_model(path)
    message = str(info.value)
    assert f"blk.0.odd.weight ({qtype.name})" in message and "supported: F32, F16, BF16" in message
    assert "Q4_K" in message and "Q8_0" in message
    assert not private_tensor_cache.exists() or not list(private_tensor_cache.glob("gguf-*"))


def test_stray_and_missing_tensors_are_named(tmp_path):
    stray = _minimal_llama(tmp_path / "a.gguf", extra_tensors=[("blk.0.extra.weight", np.zeros(32, np.float32), None)])
    with pytest.raises(WeightLoadError, match=r"unknown tensors: blk.0.extra.weight$"):
        load_model(stray)
    missing = _minimal_llama(tmp_path / "b.gguf", drop=("blk.0.ffn_up.weight",))
    with pytest.raises(WeightLoadError, match=r"missing tensors: model.layers.0.mlp.up_proj.weight$"):
        load_model(missing)
    shaped = _minimal_llama(tmp_path / "c.gguf", drop=("blk.0.ffn_up.weight",),
                            extra_tensors=[("blk.0.ffn_up.weight", np.zeros((32, 64), np.float32), None)])
    with pytest.raises(WeightLoadError, match=r"misshaped tensors: model.layers.0.mlp.up_proj.weight \(32, 64\)"):
        load_model(shaped)


# ------------------------------------------------------------------ the disk cache
def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_cache_is_written_once_then_read(tmp_path, private_tensor_cache, monkeypatch):
    path = _minimal_llama(tmp_path / "m.gguf")
    cold = _state(load_model(path, prepack=False))
    sha = GGUFFile.open(path).sha256()
    entry = weight_cache.cache_path(private_tensor_cache, sha)
    assert entry.is_file() and not list(private_tensor_cache.glob("*.tmp-*"))
    assert (private_tensor_cache / "sha256").is_dir()  # the hash is remembered per (path, size, mtime)
    monkeypatch.setattr(gguf_weights, "gguf_tensors", lambda *a: pytest.fail("dequantized again"))
    warm = _state(load_model(path, prepack=False))
    assert all(torch.equal(cold[k], warm[k]) for k in cold)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "other tensors", "fp16", "old version"])
def test_a_corrupt_cache_entry_is_rebuilt(tmp_path, private_tensor_cache, damage):
    path = _minimal_llama(tmp_path / "m.gguf")
    want = _state(load_model(path, prepack=False))
    entry = weight_cache.cache_path(private_tensor_cache, GGUFFile.open(path).sha256())
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) - 100])
    elif damage == "garbage":
        entry.write_bytes(b"\x07" * 200)
    elif damage == "empty":
        entry.write_bytes(b"")
    else:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(entry), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if damage == "other tensors":
            save_file({"x": torch.zeros(3)}, str(entry))
        elif damage == "fp16":
            save_file({k: v.half() for k, v in tensors.items()}, str(entry), metadata={"version": str(weight_cache.CACHE_VERSION)})
        else:
            save_file(tensors, str(entry), metadata={"version": "0"})
    got = _state(load_model(path, prepack=False))
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert entry.read_bytes() == data  # rebuilt, byte for byte


def test_an_interrupted_load_leaves_no_cache_entry(tmp_path, private_tensor_cache, monkeypatch):
    path = _minimal_llama(tmp_path / "m.gguf")
    real = gguf_weights.gguf_tensors

    def failing(*args):
        for i, item in enumerate(real(*args)):
            if i == 4:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(gguf_weights, "gguf_tensors", failing)
    with pytest.raises(KeyboardInterrupt):
        load_model(path)
    assert not list(private_tensor_cache.glob("gguf-*"))  # neither the entry nor its temporary file


def test_cache_off(tmp_path, private_tensor_cache, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", "off")
    load_model(_minimal_llama(tmp_path / "m.gguf"))
    assert not private_tensor_cache.exists()


def test_cache_write_failure_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(blocker / "cache"))
    model = load_model(_minimal_llama(tmp_path / "m.gguf"))
    assert model.num_layers == 1


def test_random_quant_mixes_round_trip_through_the_cache(tmp_path, private_tensor_cache):
    """Seeded: random tiny llama files in random type mixes load the same cold and warm."""
    rng = random.Random(3)
    for trial in range(3):
        path = _minimal_llama(tmp_path / f"m{trial}.gguf", drop=("blk.0.attn_q.weight",), extra_tensors=[(
            "blk.0.attn_q.weight",
            gguf.quants.quantize(np.random.default_rng(trial).standard_normal((32, 32)).astype(np.float32),
                                 q := rng.choice([Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.BF16])),
            q,
        )])
        cold, warm = _state(load_model(path, prepack=False)), _state(load_model(path))
        assert all(torch.equal(cold[k], warm[k]) for k in cold)
