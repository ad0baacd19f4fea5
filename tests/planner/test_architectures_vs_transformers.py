"""Cross-check: our per-layer attention types equal what transformers' config classes derive,
and the engine's model classes build exactly the planner's layers.

``theirs`` reads a config the way transformers 5.24's modeling code does: the config
class derives ``layer_types`` (and fills defaults), then each layer's mask is the
window / chunk of its type. A local layer whose size is None makes transformers fail
on its first forward (``test_transformers_cannot_run_a_local_layer_without_size``
checks that claim on tiny models), which is why the planner raises there.
"""

import dataclasses
import typing

import pytest

from hybridkv.errors import InvalidConfigError
from hybridkv.planner.architectures import FAMILIES, find_family, model_layers
from hybridkv.planner.hf_defaults import MULTIMODAL_DEFAULTS, TEXT_DEFAULTS
from hybridkv.planner.presets import load_model_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, assume, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.support.tiers import examples  # noqa: E402

from hybridkv.engine.models import model_class_for  # noqa: E402

CLASSES = {
    "llama4": "Llama4TextConfig",
    "gemma3": "Gemma3TextConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gpt_oss": "GptOssConfig",
    "llama": "LlamaConfig",
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5": "Qwen3_5TextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "nemotron_h": "NemotronHConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "falcon_h1": "FalconH1Config",
}
MULTIMODAL_CLASSES = {"gemma3": "Gemma3Config", "llama4": "Llama4Config", "qwen3_5": "Qwen3_5Config",
                      "qwen3_5_moe": "Qwen3_5MoeConfig"}
ERROR = "error"  # transformers builds the config but cannot run it


def ours(config):
    return [tuple(k) for k in model_layers(config).kinds]


def theirs(config):
    """(per-layer kinds or ERROR, head_dim, num_kv_heads) as transformers runs ``config``."""
    family = find_family(config)[0].name
    text = dict(config.get("text_config", config))
    for key in ("architectures", "model_type", "text_config"):
        text.pop(key, None)
    hf = getattr(transformers, CLASSES[family])(**text)
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if family == "mistral":  # MistralModel: one window for every layer, layer_types unused
        types = ["sliding_attention" if window is not None else "full_attention"] * hf.num_hidden_layers
    if types is None:
        types = ["full_attention"] * hf.num_hidden_layers
    out = []
    for t in types:
        size = {"sliding_attention": window, "chunked_attention": getattr(hf, "attention_chunk_size", None)}.get(t)
        if t == "full_attention":
            out.append(("full", None))
        elif size is None:
            return ERROR, None, None
        else:
            out.append(("sliding" if t == "sliding_attention" else "chunked", size))
    head_dim = hf.head_dim if getattr(hf, "head_dim", None) else hf.hidden_size // hf.num_attention_heads
    return out, head_dim, hf.num_key_value_heads


def check_against_transformers(config):
    expected, head_dim, kv_heads = theirs(config)
    if expected == ERROR:
        with pytest.raises(InvalidConfigError, match="transformers cannot run such a layer"):
            model_layers(config)
        return None
    m = model_layers(config)
    assert ours(config) == expected
    assert (m.head_dim, m.num_kv_heads) == (head_dim, kv_heads)
    return m


def base(arch, **kw):
    return {"architectures": [arch], "num_hidden_layers": 8, "num_attention_heads": 4, "hidden_size": 256, **kw}


CASES = {
    **{name: load_model_config(name).config for name in
       ("llama4-scout", "gemma-3-27b", "mistral-7b", "gpt-oss-20b", "llama-3.1-8b")},
    "llama4-explicit-rope": {"architectures": ["Llama4ForCausalLM"], "text_config": base(
        "x", num_key_value_heads=2, head_dim=64, no_rope_layers=[1, 0, 1, 1, 0, 0, 1, 1], attention_chunk_size=128)},
    "llama4-interval-3": base("Llama4ForCausalLM", num_key_value_heads=2, head_dim=64, no_rope_layer_interval=3),
    "gemma3-pattern-3": base("Gemma3ForCausalLM", num_key_value_heads=1, head_dim=64, sliding_window_pattern=3,
                             sliding_window=512),
    # google/gemma-3-4b-it's text_config: no heads, KV heads nor head_dim (8, 4, 256 by default)
    "gemma-3-4b-it": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}},
    "qwen2-no-sliding": base("Qwen2ForCausalLM", num_key_value_heads=2, sliding_window=64, max_window_layers=3),
    "qwen2-sliding": base("Qwen2ForCausalLM", num_key_value_heads=2, sliding_window=64, max_window_layers=3,
                          use_sliding_window=True),
    "qwen3-sliding-types": base("Qwen3ForCausalLM", num_key_value_heads=2, use_sliding_window=True,
                                sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 4),
    "qwen3-types-without-use": base("Qwen3ForCausalLM", sliding_window=32,
                                    layer_types=["sliding_attention", "full_attention"] * 4),
    "gpt-oss-derived": base("GptOssForCausalLM", num_key_value_heads=2, head_dim=64),
    "gpt-oss-null-window": base("GptOssForCausalLM", num_key_value_heads=2, head_dim=64, sliding_window=None),
    "mistral-null-window": base("MistralForCausalLM", num_key_value_heads=2, sliding_window=None),
    "llama4-types-null-chunk": base("Llama4ForCausalLM", attention_chunk_size=None,
                                    layer_types=["chunked_attention", "full_attention"] * 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_types_match_transformers(name):
    check_against_transformers(CASES[name])


def test_gemma_3_4b_it_reads_transformers_defaults():
    m = model_layers(CASES["gemma-3-4b-it"])
    assert (m.num_kv_heads, m.head_dim) == (4, 256)
    assert [k.kind for k in m.kinds] == (["sliding"] * 5 + ["full"]) * 5 + ["sliding"] * 4


# ------------------------------------------------------------------ the defaults tables
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_defaults_table_is_transformers(family):
    fields = {f.name: f.default for f in dataclasses.fields(getattr(transformers, CLASSES[family]))}
    table = dict(TEXT_DEFAULTS[family])
    if family == "gemma3":  # read from **kwargs in Gemma3TextConfig.__post_init__, not a field
        assert table.pop("sliding_window_pattern") == 6
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # read from **kwargs in __post_init__, not a field
        assert "full_attention_interval" not in fields and table.pop("full_attention_interval") == 4
    if family in ("qwen2", "granitemoehybrid", "falcon_h1"):  # no head_dim field: hidden // heads
        assert "head_dim" not in fields and table.pop("head_dim") is None
    assert {k: fields[k] for k in table} == table
    assert "num_hidden_layers" not in table and "hidden_size" not in table  # required on purpose


@pytest.mark.parametrize("family", list(MULTIMODAL_DEFAULTS))
def test_multimodal_defaults_are_transformers(family):
    fields = {f.name: f.default for f in dataclasses.fields(getattr(transformers, MULTIMODAL_CLASSES[family]))}
    assert {k: fields[k] for k in MULTIMODAL_DEFAULTS[family]} == dict(MULTIMODAL_DEFAULTS[family])


# ------------------------------------------------------------------ what transformers fails on
TINY = dict(vocab_size=32, hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            num_hidden_layers=2)


@pytest.mark.parametrize("family, cls, extra", [
    ("qwen2", "Qwen2", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("qwen3", "Qwen3", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("gemma3", "Gemma3Text", dict(head_dim=16, sliding_window=None)),
    ("gpt_oss", "GptOss", dict(head_dim=16, sliding_window=None, num_local_experts=2)),
    ("llama4", "Llama4Text", dict(head_dim=16, attention_chunk_size=None, intermediate_size_mlp=32, moe_layers=[],
                                  layer_types=["chunked_attention", "full_attention"])),
])
def test_transformers_cannot_run_a_local_layer_without_size(family, cls, extra):
    config = getattr(transformers, f"{cls}Config")(**TINY, **extra)
    config._attn_implementation = "eager"
    name = "Gemma3ForCausalLM" if family == "gemma3" else f"{cls.removesuffix('Text')}ForCausalLM"
    model = getattr(transformers, name)(config).eval()
    with pytest.raises((TypeError, ValueError)):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(InvalidConfigError, match="transformers cannot run such a layer"):
        model_layers({"architectures": [name], **TINY, **extra})


# ------------------------------------------------------------------ random configs of every family
ARCH = {"llama4": "Llama4ForCausalLM", "gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
        "llama": "LlamaForCausalLM"}
MULTIMODAL_ARCH = {"llama4": "Llama4ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}
ABSENT = object()


def nullable(family, key):
    """Whether transformers' config class accepts ``key: null`` (its strict dataclass refuses it otherwise)."""
    field = {f.name: f for f in dataclasses.fields(getattr(transformers, CLASSES[family]))}.get(key)
    return field is None or type(None) in typing.get_args(field.type)


@st.composite
def configs(draw):
    """A config.json of a random family; each key absent, null or a value (sizes 1 and odd included)."""
    family = draw(st.sampled_from(list(ARCH)))
    n = draw(st.integers(1, 9))
    heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
    text = {"num_hidden_layers": n, "num_attention_heads": heads, "hidden_size": heads * draw(st.sampled_from([8, 16]))}

    def maybe(key, values, null=True):
        options = [st.just(ABSENT)] + ([st.just(None)] if null and nullable(family, key) else []) + [values]
        value = draw(st.one_of(*options))
        if value is not ABSENT:
            text[key] = value

    maybe("num_key_value_heads", st.sampled_from([d for d in (1, 2, 3, 4, 8) if heads % d == 0]))
    if family != "qwen2":
        maybe("head_dim", st.sampled_from([8, 16]))
    size = st.integers(1, 5000) | st.sampled_from([1, 2, 3, 7, 16])
    local = "chunked_attention" if family == "llama4" else "sliding_attention"
    if family != "llama":
        maybe("layer_types", st.lists(st.sampled_from(["full_attention", local]), min_size=n, max_size=n), null=False)
    if family == "llama4":
        maybe("attention_chunk_size", size)
        maybe("no_rope_layers", st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n) | st.just([]), null=False)
        maybe("no_rope_layer_interval", st.integers(1, 5), null=False)
    elif family != "llama":
        maybe("sliding_window", size)
    if family in ("qwen2", "qwen3"):
        maybe("use_sliding_window", st.booleans(), null=False)
        maybe("max_window_layers", st.integers(0, n + 1), null=False)
    if family == "gemma3":
        maybe("sliding_window_pattern", st.integers(1, 7), null=False)
    if family in MULTIMODAL_ARCH and draw(st.booleans()):
        text["model_type"] = f"{family}_text"
        return {"architectures": [MULTIMODAL_ARCH[family]], "model_type": family, "text_config": text}
    return {"architectures": [ARCH[family]], **text}


def engine_layers(config):
    """The engine model of ``config`` (on the meta device: no memory): its kinds and specs."""
    with torch.device("meta"):
        model = model_class_for(config)(config)
    return model.layer_attention_types(), model.kv_cache_specs(16, "bfloat16")


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_random_configs_planner_equals_transformers_and_engine_equals_planner(config):
    m = check_against_transformers(config)
    event(f"{find_family(config)[0].name}: {'refused' if m is None else 'runs'}")
    if m is None:  # the engine refuses it with the planner's message
        with pytest.raises(InvalidConfigError, match="transformers cannot run such a layer"):
            engine_layers(config)
        return
    assume((config.get("text_config") or config)["num_attention_heads"] % m.num_kv_heads == 0)  # else both refuse
    kinds, specs = engine_layers(config)
    assert kinds == ours(config)
    assert specs == list(model_layers(config, dtype="bfloat16").specs)
