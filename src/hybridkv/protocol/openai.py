"""The OpenAI request bodies the server accepts, as pydantic models.

Only the request side is modelled: it is what must be validated (types, ranges) before
anything reaches the engine. Responses are built as plain dicts in
:mod:`hybridkv.server.serving`, in OpenAI's shapes.

Types are strict where a coercion would hide a client bug: ``max_tokens: "16"`` or a
``bool`` where an int belongs is a 400, not a silent conversion. Fields OpenAI defines
that hybridkv cannot honour yet are accepted only at their neutral value (``best_of`` = 1,
no ``suffix``, OpenAI's legacy ``functions`` / ``function_call``, vLLM's
``continue_final_message``, ...): any other value is a 400 that names the parameter
(:func:`unsupported`). ``null`` for an optional field is its default (generated clients send
``"stream": null``, ``"n": null``); for a required one it is a 400. vLLM's legacy
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (and
``guided_whitespace_pattern``) mean what its ``structured_outputs`` fields of those names mean
(:func:`structured_outputs_of`). Other unknown fields are ignored, as vLLM and OpenAI do.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from hybridkv.errors import InvalidArgumentError

__all__ = [
    "CHAT_ROLES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "chat_echo",
    "chat_messages",
    "chat_tools",
    "completion_prompt_list",
    "structured_outputs_of",
    "valid_text",
    "unsupported",
    "wire_finish_reason",
]

Number = Union[StrictInt, StrictFloat]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``null`` for a field that has a default is that default (``"stream": null`` is false)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


class StreamOptions(_Model):
    include_usage: StrictBool = False


class _Sampling(_Model):
    """The parameters both endpoints share."""

    model: Optional[StrictStr] = None  # None: the served model
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None  # None: 1.0, OpenAI's default
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None  # vLLM's extension; 0 or -1: off
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    n: Optional[StrictInt] = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    # vLLM's definitions (SamplingParams); logit_bias keys are token ids as strings (OpenAI's)
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Any]] = None
    best_of: Optional[StrictInt] = None
    min_tokens: Optional[StrictInt] = None
    use_beam_search: Optional[StrictBool] = None
    # vLLM's: score the prompt, each token's logprob and this many top alternatives (0..20)
    prompt_logprobs: Optional[StrictInt] = None
    # OpenAI's (``json_object``, ``json_schema``; ``text`` is neutral) and vLLM's ``structured_outputs``
    # (``{"json" | "json_object" | "regex" | "choice" | "grammar": ...}``): :func:`structured_outputs_of`
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # vLLM's legacy names of structured_outputs' fields (:data:`GUIDED`), and its backend choice (refused)
    guided_json: Optional[Union[StrictStr, dict[str, Any], StrictBool]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None
    guided_whitespace_pattern: Optional[StrictStr] = None
    guided_decoding_backend: Optional[StrictStr] = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a list of either (one choice each)."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    logprobs: Optional[StrictInt] = None  # 0..20 top alternatives per token
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None


#: the message roles OpenAI's chat API takes ("function": its deprecated one); any other is a 400
#: naming ``messages`` (vLLM would pass a custom role to the chat template; OpenAI refuses it)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(_Model):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    # text, or OpenAI's content parts (only ``{"type": "text", "text": ...}`` parts are supported)
    content: Union[StrictStr, list[dict[str, Any]], None] = None
    name: Optional[StrictStr] = None
    # an assistant's calls (OpenAI's ``[{"id", "type": "function", "function": {"name", "arguments": str}}]``)
    # and a ``tool`` message's answer to one: :func:`chat_messages` checks and renders them
    tool_calls: Optional[list[Any]] = None
    tool_call_id: Optional[StrictStr] = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; the chat template renders ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None  # 0..20, with logprobs
    max_completion_tokens: Optional[StrictInt] = None  # OpenAI's newer name for max_tokens
    tools: Optional[list[Any]] = None  # OpenAI's function tools: :func:`chat_tools`
    tool_choice: Optional[Any] = None  # "none" | "auto" | "required" | {"type": "function", ...}: server.tools
    add_generation_prompt: StrictBool = True
    # vLLM's: true and the last message's role is the reply's ("assistant"): its content starts
    # the reply's content (:func:`chat_echo`)
    echo: StrictBool = False
    # refused unless neutral (:data:`_NEUTRAL`): OpenAI's legacy function calling, vLLM's continuation
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    continue_final_message: Optional[StrictBool] = None


#: parameter -> (its neutral value(s), why another value is refused)
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "best_of > 1 is not supported (as in vLLM's V1 engine; n samples are)"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "suffix": ((None,), "suffix is not supported"),
    "functions": ((None,), "the legacy functions are not supported; give them as tools"),
    "function_call": ((None,), "the legacy function_call is not supported; use tool_choice"),
    "continue_final_message": ((None, False), "continue_final_message is not supported (the reply always "
                                              "starts a new assistant message)"),
    "guided_decoding_backend": ((None,), "guided_decoding_backend is not supported (hybridkv's grammars are "
                                         "llguidance's)"),
}

#: vLLM's legacy request fields -> the ``structured_outputs`` field each one sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def unsupported(request: _Model) -> tuple[str, str] | None:
    """The first parameter set to a value hybridkv cannot honour, and why; None if none."""
    for name, (neutral, why) in _NEUTRAL.items():
        if name in type(request).model_fields:
            value = getattr(request, name)
            if not any(value == v and type(value) is type(v) for v in neutral) and not (
                value is None and None in neutral
            ):
                return name, f"{why} (got {name}={value!r:.60})"
    return None


def structured_outputs_of(request: _Sampling) -> tuple[dict[str, Any], str] | None:
    """What the request's output must match, as ``StructuredOutputsParams`` fields (vLLM's), and
    the parameter that said it (``"response_format"`` or ``"structured_outputs"``, for the error
    that names it); None: free text. OpenAI's ``response_format``: ``{"type": "text"}`` (free),
    ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict", ...}}`` (the schema, enforced as given whatever ``strict`` says;
    no ``schema``: any JSON object). vLLM's legacy ``guided_*`` fields (:data:`GUIDED`) set the
    ``structured_outputs`` field of their name and are named in errors. A bad shape, another type,
    or two of these set: an InvalidArgumentError naming a parameter. Whether the schema compiles is
    the engine's check."""
    fmt, so = request.response_format, request.structured_outputs
    guided = [name for name in GUIDED if getattr(request, name) is not None]
    if request.guided_whitespace_pattern is not None and request.guided_json is None:
        raise InvalidArgumentError("guided_whitespace_pattern needs guided_json", param="guided_whitespace_pattern")
    if guided:
        if len(guided) > 1 or fmt is not None or so is not None:
            raise InvalidArgumentError(f"give one of {', '.join(guided)}, response_format, structured_outputs",
                                       param=guided[-1])
        so = {GUIDED[guided[0]]: getattr(request, guided[0])}
        if request.guided_whitespace_pattern is not None:
            so["whitespace_pattern"] = request.guided_whitespace_pattern
        return so, guided[0]
    fields: dict[str, Any] | None = None
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            fields = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise InvalidArgumentError("response_format json_schema must be an object with a schema",
                                           param="response_format")
            if not isinstance(spec.get("strict", False), (bool, type(None))):
                raise InvalidArgumentError("response_format json_schema.strict must be a boolean", param="response_format")
            schema = spec.get("schema")
            if schema is not None and not isinstance(schema, (dict, bool)):
                raise InvalidArgumentError("response_format json_schema.schema must be a JSON schema object",
                                           param="response_format")
            fields = {"json_object": True} if schema is None else {"json": schema}
        elif kind != "text":
            raise InvalidArgumentError(f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                                       f"{kind!r:.40}", param="response_format")
    if fields is not None and so is not None:
        raise InvalidArgumentError("give response_format or structured_outputs, not both", param="structured_outputs")
    if fields is not None:
        return fields, "response_format"
    return (so, "structured_outputs") if so is not None else None


def valid_text(text: str, param: str, where: str) -> str:
    """``text`` if it is valid Unicode (encodes to UTF-8); a lone surrogate such as a JSON
    ``"\\ud800"`` is an InvalidArgumentError naming ``param`` (a 400, never the tokenizer's 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{where} is not valid Unicode: an unpaired surrogate (U+{ord(text[exc.start]):04X}) at "
            f"character {exc.start}", param=param,
        ) from None
    return text


def completion_prompt_list(req: CompletionRequest) -> list[Any]:
    """The prompts of a completions request: text or token ids, one or a list (one choice each)."""
    p = req.prompt
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
        prompts: list[Any] = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise InvalidArgumentError("the prompt is empty", param="prompt")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            valid_text(prompt, "prompt", "the prompt" if len(prompts) == 1 else f"prompt {i}")
    return prompts


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages to render: text content as is, text parts joined (other parts refused).

    A ``developer`` message is rendered as ``system``: OpenAI's newer name for the same
    instructions, which chat templates (written for system / user / assistant / tool) do not
    know -- some would refuse it (Gemma's), some drop it silently (Qwen's). Every other role
    reaches the template as given."""
    if not req.add_generation_prompt:
        raise InvalidArgumentError("add_generation_prompt=false is not supported", param="add_generation_prompt")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidArgumentError(
                        f"message {i}: only text content parts are supported, got {part!r:.60}", param="messages"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        role = "system" if m.role == "developer" else m.role
        message = {"role": role, "content": valid_text(content or "", "messages", f"message {i}'s content")}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(i, c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def _template_call(i: int, call: Any) -> dict:
    """An assistant message's tool call as HF chat templates expect it: OpenAI's shape with
    ``arguments`` parsed into an object (a JSON text that is not one: InvalidArgumentError)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or call.get("type", "function") != "function":
        raise InvalidArgumentError(f"message {i}: a tool call must be {{\"type\": \"function\", \"function\": "
                                   f"{{\"name\", \"arguments\"}}}}, got {call!r:.80}", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise InvalidArgumentError(f"message {i}: tool call arguments are not JSON: {args!r:.60}",
                                       param="messages") from None
    if not isinstance(args, dict):
        raise InvalidArgumentError(f"message {i}: tool call arguments must be a JSON object", param="messages")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def chat_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The request's ``tools`` for the chat template (``tools: []`` or none: None), each
    OpenAI's ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
    (a name of letters, digits, ``_`` and ``-``, at most 64; names unique; ``parameters`` a JSON
    schema object). Any other entry: InvalidArgumentError naming ``tools``."""
    if not req.tools:
        return None
    out, names = [], set()
    for i, tool in enumerate(req.tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidArgumentError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}, got '
                                       f"{tool!r:.60}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name) or name in names:
            raise InvalidArgumentError(f"tools[{i}].function.name must be a new name of at most 64 letters, digits, "
                                       f"'_' or '-', got {name!r:.70}", param="tools")
        if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("parameters", {}), dict):
            raise InvalidArgumentError(f"tools[{i}].function: description must be a str and parameters a JSON "
                                       f"schema object", param="tools")
        names.add(name)
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}})
    return out


def chat_echo(req: ChatCompletionRequest, messages: list[dict]) -> str:
    """What a chat reply starts with (vLLM's ``echo``): with ``echo`` true and the last rendered
    message's role the reply's (``"assistant"``: hybridkv always adds the generation prompt),
    that message's content; else the empty string. ``messages`` are :func:`chat_messages`'."""
    if req.echo and messages and messages[-1]["role"] == "assistant":
        return messages[-1]["content"]
    return ""


def wire_finish_reason(reason: str | None) -> str | None:
    """The finish reason on the wire (responses, metrics): the engine's ``"aborted"`` is vLLM's
    ``"abort"``; ``"stop"``, ``"length"``, ``"error"`` and None pass through."""
    return "abort" if reason == "aborted" else reason
