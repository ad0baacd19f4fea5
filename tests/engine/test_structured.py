"""Structured outputs (SamplingParams.structured_outputs over llguidance) on the tiny models.

The tiny Gemma 3 (``tiny_dir``) has a 128-id character tokenizer (letters, digits, ``▁``, EOS
``</s>`` = 2, no braces): regexes, choices and Lark grammars run on it; JSON runs on a tiny Llama
with 300 ids and the byte-level tokenizer. Every constrained output is replayed through an
independent llguidance matcher built here from the tokenizer's bytes: each token must be
allowed where it was sampled.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("transformers")

import llguidance as llg  # noqa: E402
import llguidance.numpy as llg_np  # noqa: E402

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.llm import LLM  # noqa: E402
from hybridkv.engine.sampling import Sampler  # noqa: E402
from hybridkv.engine.structured import banned_numpy, banned_torch, grammar_text, mask_logits  # noqa: E402
from hybridkv.errors import InvalidArgumentError  # noqa: E402
from hybridkv.sampling_params import SamplingParams  # noqa: E402
from hybridkv.structured_outputs import StructuredOutputsParams as SO  # noqa: E402
from hybridkv.tokenizer.token_bytes import TokenSpeller, token_bytes  # noqa: E402

from tests.support.tiny_server import engine_config  # noqa: E402

PROMPTS = ["hello", "abc world", "Zq9", "the end."]
EOS = 2  # the tiny tokenizer's </s>


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), engine_config())


class _Vocab:
    """An llguidance tokenizer of our own, for the replay (not the engine's objects)."""

    def __init__(self, tokenizer, vocab_size, eos):
        self.tokens = token_bytes(tokenizer, vocab_size)
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.spell = TokenSpeller(tokenizer, self.tokens, self.special_token_ids)

    def __call__(self, data: bytes) -> list[int]:
        return self.spell(data)


def replay(tokenizer, vocab_size: int, so: SO, tokens, eos: int) -> bool:
    """Every token of ``tokens`` allowed, in turn, by a fresh matcher of ``so``; returns whether the
    grammar is complete after them (a final EOS consumed as llguidance's end)."""
    ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tokenizer, vocab_size, eos)))
    m = llg.LLMatcher(ll, grammar_text(so), log_level=0)
    mask = llg_np.allocate_token_bitmask(1, ll.vocab_size)
    for i, t in enumerate(tokens):
        llg_np.fill_next_token_bitmask(m, mask)
        assert (int(mask[0, t >> 5]) >> (t & 31)) & 1, f"token {t} at {i} is outside the grammar"
        assert m.consume_token(t), m.get_error()
    return m.is_stopped()


def test_regex_choice_and_grammar_outputs_match(llm):
    cases = [(SO(regex=r"[a-c]{2,5}x"), lambda t: re.fullmatch(r"[a-c]{2,5}x", t)),
             (SO(regex=r"(ab|c)+ d[0-9]{2}"), lambda t: re.fullmatch(r"(ab|c)+ d[0-9]{2}", t)),
             (SO(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
             (SO(grammar='start: "a" b+ "z"\nb: "b" | "c"'), lambda t: re.fullmatch(r"a[bc]+z", t))]
    for so, ok in cases:
        params = [SamplingParams(max_tokens=60, structured_outputs=so),
                  SamplingParams(max_tokens=60, temperature=1.0, seed=7, structured_outputs=so)]
        for out in llm.generate(PROMPTS[:2], params):
            assert replay(llm.tokenizer, llm.model.vocab_size, so, out.token_ids, EOS) or out.finish_reason == "length"
            if out.finish_reason == "stop":
                assert ok(out.text), (so, out.text)
                assert out.token_ids[-1] == EOS and out.stop_reason == EOS  # ended at EOS, like any request
    # the greedy rows of the finite grammars must finish
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, structured_outputs=SO(choice=["yes", "no"])))
    assert {o.finish_reason for o in outs} == {"stop"} and {o.text for o in outs} <= {"yes", "no"}


def test_without_eos_a_finished_grammar_ends_the_request(llm, tiny_dir):
    """The tiny model has no EOS of its own: an engine without the text front's EOS ids (and
    ``ignore_eos`` on the text front) ends the request when its matcher is stopped."""
    so = SO(regex=r"[a-c]{2,5}x")
    engine = LLMEngine(str(tiny_dir), engine_config())  # the engine loads the checkpoint's tokenizer itself
    assert engine.eos_token_ids == ()
    ids = llm.encode("hello")
    [out] = engine.generate([ids], SamplingParams(max_tokens=40, structured_outputs=so))
    assert out.finish_reason == "stop" and out.error is None
    assert re.fullmatch(r"[a-c]{2,5}x", llm.tokenizer.decode(out.output_token_ids))
    assert EOS not in out.output_token_ids
    [ignoring] = llm.generate(["hello"], SamplingParams(max_tokens=40, ignore_eos=True, structured_outputs=so))
    assert ignoring.finish_reason == "stop" and ignoring.token_ids == out.output_token_ids
    # a grammar that needs more tokens than max_tokens stops at the length, as any request
    [short] = llm.generate(["hello"], SamplingParams(max_tokens=3, structured_outputs=SO(regex="[a-c]{10}")))
    assert short.finish_reason == "length" and re.fullmatch("[a-c]{3}", short.text)
    assert len(engine.structured) == 0 and len(llm.engine.structured) == 0  # every matcher dropped


def test_min_tokens_and_ignore_eos_do_not_leak_eos(llm):
    """Where EOS cannot end the request its bit is cleared while the grammar allows more."""
    so = SO(regex=r"[a-c]+x?")
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=12, min_tokens=6, structured_outputs=so))
    # EOS is held back for 6 tokens; a grammar complete before then ends the request ("stop")
    assert EOS not in out.token_ids[:6] and re.fullmatch(r"[a-c]+x?", out.text)
    assert len(out.token_ids) >= 6 or out.text.endswith("x")
    [free] = llm.generate(["hello"], SamplingParams(max_tokens=12, ignore_eos=True, structured_outputs=so))
    assert EOS not in free.token_ids and re.fullmatch(r"[a-c]+x?", free.text)


def test_mixed_batches_leave_free_rows_as_they_were(llm):
    so = SO(regex=r"[0-9]{3}x[a-z]{4}")
    free = SamplingParams(max_tokens=10)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=11)
    alone = llm.generate(PROMPTS, [free, seeded, free, seeded])
    mixed = llm.generate(PROMPTS + PROMPTS, [free, seeded, free, seeded] + [SamplingParams(max_tokens=20, structured_outputs=so)] * 4)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for out in mixed[4:]:
        assert out.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}x[a-z]{4}", out.text)


def test_both_sampler_paths_give_the_same_constrained_tokens(llm, monkeypatch):
    so = SO(regex=r"[a-e]{4,12}")
    params = [SamplingParams(max_tokens=16, structured_outputs=so), SamplingParams(max_tokens=16, structured_outputs=so)]
    cpu = llm.generate(PROMPTS[:2], params)
    monkeypatch.setattr(llm.engine.runner, "sampler", Sampler(seed=0, on_device=True))
    batched = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in cpu]
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, seed=3, structured_outputs=so))
    assert all(re.fullmatch(r"[a-e]{4,12}", o.text) for o in sampled if o.finish_reason == "stop")


def test_mask_rows_on_both_unpackings_and_paths():
    gen = torch.Generator().manual_seed(0)
    vocab, words = 77, 3
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 4  # row 1 allows token 68 only
    assert torch.equal(banned_numpy(bitmask, vocab), banned_torch(bitmask, vocab))
    want = [[not (int(bitmask[j, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for j in range(3)]
    assert banned_numpy(bitmask, vocab).tolist() == want
    logits = torch.randn(5, vocab, generator=gen)
    before = logits.clone()
    masked = mask_logits(logits, [0, 2, 4], bitmask)
    assert torch.equal(logits, before)  # the model's logits are never written
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])
    assert torch.isneginf(masked[2]).sum() == vocab - 1 and masked[2, 68] == logits[2, 68]
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams(), SamplingParams(),
              SamplingParams(temperature=0.7, seed=9, top_k=5)]
    for on_device in (False, True):
        tokens = Sampler(0, on_device=on_device).sample_rows(logits, params, [0] * 5, allowed=([0, 2, 4], bitmask))
        assert tokens[2] == 68 and not want[0][tokens[0]] and not want[2][tokens[4]]
        greedy = tokens[0], tokens[2], tokens[3]
        if on_device:
            assert greedy == first
        first = greedy


def test_preemption_keeps_constrained_outputs(tiny_dir, llm):
    so = SO(regex=r"[a-e]{18,24}x")
    prompts = [llm.encode(p * 3) for p in PROMPTS]
    params = SamplingParams(max_tokens=30, structured_outputs=so)
    roomy = LLMEngine(str(tiny_dir), EngineConfig(block_size=4, num_blocks=400, max_num_batched_tokens=16, max_model_len=256))
    want = roomy.generate(prompts, params)
    peak = roomy.scheduler.peak_blocks(max(map(len, prompts)) + 30)
    tight = LLMEngine(str(tiny_dir), EngineConfig(block_size=4, num_blocks=peak + 6, max_num_batched_tokens=16,
                                                  max_model_len=256, admission="first_chunk"))
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    for out in got:
        assert out.finish_reason == "stop" and re.fullmatch(r"[a-e]{18,24}x", llm.tokenizer.decode(out.output_token_ids))
        assert replay(llm.tokenizer, llm.model.vocab_size, so, out.output_token_ids, EOS)


@pytest.mark.parametrize("fields", [{"regex": "a(b"}, {"grammar": "start: nothing_here"},
                                    {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
                                    {"json": {"type": "string", "minLength": 5, "maxLength": 2}}])
def test_a_grammar_that_does_not_compile_is_refused_before_queueing(llm, fields):
    engine = llm.engine
    with pytest.raises(InvalidArgumentError) as err:
        engine.add_request(llm.encode("hi"), SamplingParams(structured_outputs=SO(**fields)))
    assert err.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests() and not engine.scheduler.sequences and len(engine.structured) == 0


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["b"]}, {"json_object": 1}, {"choice": []},
                                    {"choice": "ab"}, {"json": "{bad"}, {"json": [1]}, {"regex": ""},
                                    {"regex": "a", "whitespace_pattern": " "}, {"bogus": 1}])
def test_bad_shapes_name_structured_outputs(fields):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(structured_outputs=fields)  # vLLM's dict form goes through the same checks
    assert err.value.param == "structured_outputs"


def test_params_are_hashable_and_normalized():
    a = SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"b": {}, "a": {}}}})
    b = SamplingParams(structured_outputs=SO(json='{"type": "object", "properties": {"b": {}, "a": {}}}'))
    assert a == b and hash(a) == hash(b)
    assert list(json.loads(a.structured_outputs.json)["properties"]) == ["b", "a"]  # generation order kept
    assert SO(choice=["x", "y"]).choice == ("x", "y") and SO(choice=["x"]).kind == "choice"


def test_grammars_compile_once_per_distinct_text(llm):
    st = llm.engine.structured
    so = SO(regex=r"q[0-9]+z")
    first = st.matcher(so)
    entries = len(st._cache)
    second = st.matcher(SO(regex=r"q[0-9]+z"))
    assert len(st._cache) == entries and first is not second  # one compile, a copy per request
    assert second.consume_token(llm.tokenizer.encode("q", add_special_tokens=False)[-1])
    assert not first.is_error() and first.validate_tokens(llm.tokenizer.encode("q", add_special_tokens=False)[-1:]) == 1


def test_a_matcher_error_ends_that_request_only(llm):
    engine = llm.engine
    so = SO(regex=r"[a-c]{30}")
    good = engine.add_request(llm.encode("hello"), SamplingParams(max_tokens=8, structured_outputs=so))
    bad = engine.add_request(llm.encode("hello"), SamplingParams(max_tokens=8, structured_outputs=so))
    free = engine.add_request(llm.encode("hello"), SamplingParams(max_tokens=8))
    engine.structured._rows[bad].matcher.consume_token(llm.tokenizer.encode("z", add_special_tokens=False)[-1])
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs[bad].finish_reason == "error" and "structured outputs" in outs[bad].error
    assert outs[good].finish_reason == "length" and len(outs[good].output_token_ids) == 8 and outs[good].error is None
    assert outs[free].finish_reason == "length" and outs[free].error is None
    assert len(engine.structured) == 0 and not engine.structured.errors


def test_a_batch_without_grammars_takes_todays_path(llm, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("masked a batch without grammars")

    monkeypatch.setattr("hybridkv.engine.sampling.mask_logits", boom)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert llm.engine.runner.structured.masks([]) is None


def test_abort_drops_the_matcher(llm):
    engine = llm.engine
    rid = engine.add_request(llm.encode("hi"), SamplingParams(max_tokens=8, structured_outputs=SO(regex="[ab]+")))
    assert len(engine.structured) == 1
    engine.step()
    assert engine.abort_request(rid).finish_reason == "aborted" and len(engine.structured) == 0


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny Llama with 300 ids, no tokenizer files (the byte-level tokenizer) and no EOS."""
    import transformers as tf

    path = tmp_path_factory.mktemp("byte-llama")
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return LLM(str(path), EngineConfig(block_size=8, num_blocks=256, max_model_len=512))


SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", 7]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["ok", "pick", "n", "tags"], "additionalProperties": False}


def _valid(value) -> bool:
    return (isinstance(value, dict) and set(value) == set(SCHEMA["properties"]) and isinstance(value["ok"], bool)
            and value["pick"] in ("red", "green", 7) and type(value["n"]) is int and 0 <= value["n"] <= 99
            and isinstance(value["tags"], list) and len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b"})


def test_json_on_a_byte_level_model(byte_model):
    so = SO(json=SCHEMA, disable_any_whitespace=True)  # a finite language: every output ends
    params = [SamplingParams(max_tokens=120, structured_outputs=so)]
    params += [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=so) for s in range(3)]
    outs = byte_model.generate(["x", "{", "say", "json"], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert _valid(json.loads(out.text)), out.text
        assert replay(byte_model.tokenizer, byte_model.model.vocab_size, so, out.token_ids, 256)
    [obj] = byte_model.generate(["x"], SamplingParams(max_tokens=60, structured_outputs=SO(json_object=True)))
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length" and obj.text.lstrip().startswith("{")


def test_a_grammar_the_vocabulary_cannot_spell_ends_with_an_error(llm):
    """The tiny vocabulary has no "{": a JSON object is a dead end, reported as the request's error."""
    [out] = llm.generate(["hi"], SamplingParams(max_tokens=8, structured_outputs=SO(json_object=True)))
    rid = llm.engine.add_request(llm.encode("hi"), SamplingParams(max_tokens=8, structured_outputs=SO(json_object=True)))
    errors = {}
    while llm.engine.has_unfinished_requests():
        errors.update((o.request_id, o.error) for o in llm.engine.step())
    assert out.finish_reason == "error" and len(out.token_ids) <= 1
    assert errors[rid].startswith("structured outputs: ") and len(llm.engine.structured) == 0


def test_without_llguidance_a_structured_request_names_the_extra(llm, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)
    with pytest.raises(InvalidArgumentError, match=r"pip install 'hybridkv\[structured\]'") as err:
        llm.engine.add_request(llm.encode("hi"), SamplingParams(structured_outputs=SO(regex="a")))
    assert err.value.param == "structured_outputs" and not llm.engine.has_unfinished_requests()
