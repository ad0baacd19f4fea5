"""Chat templates, rendered as transformers renders them (``utils/chat_template_utils.py``).

A jinja2 ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` / ``lstrip_blocks`` and the loop
controls extension; globals ``raise_exception``, ``strftime_now``, ``namespace`` (no
underscore attributes); ``tojson`` without HTML escaping. The template sees ``messages``,
``add_generation_prompt``, the special token strings (``bos_token``, ``eos_token``, ...) and
any extra keyword arguments, all rebuilt from plain JSON types. Anything that goes wrong (no
template, a syntax error, ``raise_exception``, a sandbox refusal, an undefined call) is one
``ChatTemplateError`` line; malformed messages are an ``InvalidArgumentError``.

Usage::

    render_chat_template(template, [{"role": "user", "content": "Hi"}], True, {"bos_token": "<s>"})
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

from hybridkv.errors import ChatTemplateError, InvalidArgumentError


def render_chat_template(
    template: str | None,
    messages: Any,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text ``template`` makes of ``messages`` (a list of ``{role, content}`` dicts)."""
    if template is None:
        raise ChatTemplateError("this tokenizer has no chat template; give a plain prompt instead")
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a str, got {type(template).__name__}")
    chat = validate_messages(messages)
    compiled = _compile(template)
    context: dict[str, Any] = {"tools": None, "documents": None}  # transformers always passes both
    context.update({k: v for k, v in (special_tokens or {}).items() if v is not None})
    context.update(_plain(kwargs))
    import jinja2

    try:
        return compiled.render(messages=chat, add_generation_prompt=bool(add_generation_prompt), **context)
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template refused by the sandbox: {_one_line(e)}") from None
    except jinja2.exceptions.TemplateError as e:  # raise_exception(...) and undefined names
        raise ChatTemplateError(f"chat template raised: {_one_line(e)}") from None
    except Exception as e:  # a template is untrusted code: any failure is its failure
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None


def validate_messages(messages: Any) -> list[dict]:
    """A fresh plain-data copy of ``messages``: a non-empty list of dicts with str ``role`` and ``content``."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidArgumentError(f"chat messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    if not messages:
        raise InvalidArgumentError("chat messages are empty")
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgumentError(f"chat message {n} must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = type(message[key]).__name__ if key in message else "nothing"
                raise InvalidArgumentError(f"chat message {n} needs a str {key!r}, got {got}")
    return [_plain(dict(m)) for m in messages]


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (what the template may touch); others become ``'<type>'``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class StrictSandbox(ImmutableSandboxedEnvironment):
        """Refuses unsafe attribute access (``x.__class__``) outright; jinja2 would render it empty."""

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe")

    env = StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _namespace_class()
    env.globals["dict"] = _TemplateDict()
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: line {e.lineno}: {_one_line(e)}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not parse: {_one_line(e)}") from None


class _TemplateDict:
    """``dict(...)`` for templates without the type itself (no ``dict.__class__`` route out)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _namespace_class():
    import jinja2
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's ``namespace`` refusing underscore-prefixed names (no route to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    return TemplateNamespace
