"""Chat templates: transformers' rendering rules, the sandbox, one-line errors, message checks."""

from __future__ import annotations

import pytest

from hybridkv.errors import ChatTemplateError, InvalidArgumentError
from hybridkv.tokenizer import render_chat_template

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


def test_tiny_template(bpe_tok):
    out = bpe_tok.apply_chat_template(MSGS[1:2])
    assert out == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert bpe_tok.apply_chat_template(MSGS[1:2], add_generation_prompt=False) == "<|im_start|>user\nU<|im_end|>\n"


def test_trim_lstrip_loop_controls_and_globals():
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m.role == 'assistant' %}{% continue %}{% endif %}\n"
        "    [{{ m.role }}:{{ m.content | tojson }}]\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
        "{% if add_generation_prompt %}GO{% endif %}{{ extra }}"
    )
    out = render_chat_template(template, MSGS, True, {"bos_token": "<s>", "eos_token": None}, extra="!")
    assert out == '<s>\n    [system:"S"]\n    [user:"U"]\n3GO!'


def test_matches_transformers_rendering():
    transformers = pytest.importorskip("transformers.utils.chat_template_utils")
    template = (
        "{% for m in messages %}{% if loop.first and m.role != 'system' %}<sys>{% endif %}"
        "{{ '<|' + m.role + '|>' }}\n  {{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    for messages in (MSGS, MSGS[1:], [{"role": "user", "content": " spaced \n"}]):
        for gen in (True, False):
            ours = render_chat_template(template, messages, gen, {"eos_token": "</s>"})
            theirs, _ = transformers.render_jinja_template(
                [messages], chat_template=template, add_generation_prompt=gen, eos_token="</s>"
            )
            assert ours == theirs[0]


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ messages.__class__ }}", "sandbox"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
        ("{{ cycler.__init__.__globals__ }}", "sandbox"),
        ("{% set x = messages.append(1) %}", "sandbox"),
        ("{% set ns = namespace(_hidden=1) %}", "sandbox"),
        ("{{ raise_exception('Only user and assistant roles\nare supported') }}", "raised: Only user and assistant roles are"),
        ("{{ undefined_function() }}", "raised"),
        ("{% for m in messages %}", "does not parse"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_bad_templates_are_one_line_errors(template, words):
    with pytest.raises(ChatTemplateError, match=words) as info:
        render_chat_template(template, MSGS)
    assert "\n" not in str(info.value)


def test_no_template(spm_tok):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        spm_tok.apply_chat_template(MSGS)
    with pytest.raises(ChatTemplateError):
        render_chat_template(42, MSGS)


@pytest.mark.parametrize(
    "messages",
    ["hello", [], [["user", "hi"]], [{"role": "user"}], [{"role": 1, "content": "x"}], [{"role": "user", "content": None}], None],
)
def test_bad_messages(messages):
    with pytest.raises(InvalidArgumentError):
        render_chat_template("{{ messages }}", messages)


def test_messages_are_copied_as_plain_data():
    class Sneaky(str):
        def format_map(self, *_):  # a method the sandbox does not know
            return "escaped"

    messages = [{"role": "user", "content": Sneaky("hi"), "meta": object()}]
    out = render_chat_template("{{ messages[0].content }}|{{ messages[0].meta }}", messages)
    assert out == "hi|<object>"
    assert isinstance(messages[0]["content"], Sneaky)  # the caller's messages are untouched
