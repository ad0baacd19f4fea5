"""The request bodies of vLLM's tokenizer routes, as pydantic models (responses are plain dicts).

* ``POST /tokenize``: :class:`TokenizeCompletionRequest` or :class:`TokenizeChatRequest`
  -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
* ``POST /detokenize``: :class:`DetokenizeRequest` -> ``{"prompt"}``.

Field names, types and defaults are vLLM's (``vllm/entrypoints/serve/tokenize/protocol.py``):
a body with ``messages`` is a chat (rendered by the chat template, ``add_special_tokens``
false by default), any other body a text ``prompt`` (``add_special_tokens`` true). Types
are strict as on the generation routes; unknown fields are ignored. vLLM's chat fields
hybridkv cannot honour are refused with a 400 naming them when set (:func:`tokenize_unsupported`):
``continue_final_message``, a per-request ``chat_template``, ``chat_template_kwargs``, ``tools``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from hybridkv.errors import InvalidArgumentError
from hybridkv.protocol.openai import ChatMessage

__all__ = [
    "DetokenizeRequest",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "tokenize_request_model",
    "tokenize_unsupported",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeCompletionRequest(_Model):
    """``POST /tokenize`` with a text: its token ids, the tokenizer's special tokens (BOS) added
    unless ``add_special_tokens`` is false (as lm-eval's remote tokenizer asks)."""

    model: Optional[StrictStr] = None  # None: the served model
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: Optional[StrictBool] = False  # also the tokens' strings (vLLM's token_strs)


class TokenizeChatRequest(_Model):
    """``POST /tokenize`` with chat messages: the ids ``/v1/chat/completions`` would give the
    same messages (the same roles, content parts and template), ``add_special_tokens`` on top of
    what the template writes (false by default, as vLLM)."""

    model: Optional[StrictStr] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: Optional[StrictBool] = False
    chat_template: Optional[StrictStr] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None


class DetokenizeRequest(_Model):
    """``POST /detokenize``: the text of ``tokens`` (special tokens kept, as vLLM decodes)."""

    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]

#: chat fields hybridkv does not honour -> their neutral values
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "continue_final_message": (False,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "tools": (None,),
}


def tokenize_request_model(body: Any) -> type[_Model]:
    """The model a ``/tokenize`` body is: a chat with ``messages``, else a text ``prompt``
    (both: InvalidArgumentError naming ``prompt``, as vLLM's either-or)."""
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise InvalidArgumentError('give "prompt" or "messages", not both', param="prompt")
        return TokenizeChatRequest
    return TokenizeCompletionRequest


def tokenize_unsupported(req: _Model) -> tuple[str, str] | None:
    """The first field set to a value hybridkv cannot honour, and why; None if none."""
    for name, neutral in _NEUTRAL.items():
        if name in type(req).model_fields:
            value = getattr(req, name)
            if not any(value is v or (value == v and type(value) is type(v)) for v in neutral):
                return name, f"{name} is not supported on /tokenize (got {name}={value!r:.60})"
    return None
