"""Tool calls on chat completions: OpenAI's ``tools`` + ``tool_choice`` with vLLM's semantics.

The tools (checked by :func:`~hybridkv.protocol.openai.chat_tools`) always reach the chat
template's ``tools`` variable. What ``tool_choice`` then does (:func:`tool_plan`):

* ``"none"`` (or no tools): free text, as without tools.
* ``"required"``: the output is constrained (structured outputs) to a JSON array of at least
  one ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` (vLLM's schema,
  ``anyOf`` over the tools); each item becomes a call.
* ``{"type": "function", "function": {"name": N}}``: the output is constrained to tool N's
  ``parameters`` schema and is that one call's arguments.
* ``"auto"``: free text; calls are parsed out of it by the server's ``--tool-call-parser``
  (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number; the
  text outside well-formed calls stays ``content``). Without a parser ``"auto"`` is a 400, as
  in vLLM (which needs ``--enable-auto-tool-choice --tool-call-parser``). Unset with tools
  is ``"auto"``, as in vLLM: tools are never silently ignored.

A reply with calls has ``message.tool_calls`` (ids ``call_<hex>``, ``type`` "function",
``arguments`` a JSON string) and ``finish_reason`` ``"tool_calls"`` (when the engine said
``"stop"``); ``content`` is None when nothing else was said. An output that does not parse
(cut by ``max_tokens``) stays ``content``. Streamed, a call is sent once complete (its text
is held back until then): a start delta ``{"index", "id", "type", "function": {"name",
"arguments": ""}}`` then one ``{"index", "function": {"arguments": ...}}`` delta, which
OpenAI's delta protocol allows (clients concatenate the argument fragments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridkv.errors import InvalidArgumentError
from hybridkv.protocol.openai import ChatCompletionRequest, chat_tools, structured_outputs_of

__all__ = ["HermesParser", "ToolPlan", "ToolStream", "finish_reason", "parse_hermes", "required_schema", "tool_plan"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ANY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's ``tool_choice`` means: ``mode`` is "none", "auto", "required" or
    "named" (``name`` the function); ``tools`` the checked tools (None: none)."""

    mode: str
    tools: list[dict] | None = None
    name: str | None = None

    @property
    def calls(self) -> bool:
        """Whether replies are turned into tool calls (every mode but "none")."""
        return self.mode != "none"

    def structured(self, req: ChatCompletionRequest) -> tuple[dict, str] | None:
        """The structured outputs the request runs under (as ``structured_outputs_of``): the
        calls' schema for "required" / "named" (with ``response_format`` or ``structured_outputs``
        too: InvalidArgumentError naming ``tool_choice``), else the request's own."""
        own = structured_outputs_of(req)
        if self.mode not in ("required", "named"):
            return own
        if own is not None:
            raise InvalidArgumentError(f"tool_choice {self.mode!r} constrains the output itself; drop {own[1]}",
                                       param="tool_choice")
        if self.mode == "required":
            return {"json": required_schema(self.tools or [])}, "tool_choice"
        [fn] = [t["function"] for t in self.tools or [] if t["function"]["name"] == self.name]
        return {"json": fn.get("parameters") or _ANY_OBJECT}, "tool_choice"

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply's ``content`` and ``tool_calls`` (none: the text is the content)."""
        parser = ToolStream(self)
        events = parser.feed(text) + parser.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = [_call(name, args) for e in events if isinstance(e, tuple) for name, args in [e]]
        return (None if calls and not content.strip() else content), calls


def tool_plan(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The request's :class:`ToolPlan` (see the module docstring); a bad ``tools`` entry is an
    InvalidArgumentError naming ``tools``, a bad or unservable ``tool_choice`` one naming ``tool_choice``."""
    tools = chat_tools(req)
    choice = req.tool_choice
    names = [t["function"]["name"] for t in tools or []]
    if choice is None:
        choice = "auto" if tools else "none"  # vLLM's default with tools (a 400 below without a parser)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidArgumentError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                       f'"function": {{"name": ...}}}}, got {choice!r:.60}', param="tool_choice")
        if name not in names:
            raise InvalidArgumentError(f"tool_choice names the function {name!r:.64}, which is not in tools",
                                       param="tool_choice")
        return ToolPlan("named", tools, name)
    if choice not in ("none", "auto", "required"):
        raise InvalidArgumentError(f'tool_choice must be "none", "auto", "required" or a function, got {choice!r:.60}',
                                   param="tool_choice")
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan("none", tools)
    if not tools:
        raise InvalidArgumentError("tool_choice 'required' needs tools", param="tool_choice")
    if choice == "auto" and parser is None:
        raise InvalidArgumentError("tool_choice 'auto' needs a server started with --tool-call-parser (vLLM's "
                                   "--enable-auto-tool-choice --tool-call-parser); use 'required', a named "
                                   "function or 'none'", param="tool_choice")
    return ToolPlan(choice, tools)


def required_schema(tools: list[dict]) -> dict:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of ``{"name", "parameters"}``,
    each item one of the tools (``anyOf``) with that tool's parameters."""
    items = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or _ANY_OBJECT},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes_body(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a Hermes call's body; None: not a well-formed call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    args = call.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return call["name"], json.dumps(args, ensure_ascii=False)


class HermesParser:
    """Hermes calls found incrementally: :meth:`feed` text, then :meth:`finish`; each returns
    events, a ``str`` (content) or a ``(name, arguments)`` call. Content that may start a
    ``<tool_call>`` tag and a call's text are held back until they are decided; a malformed
    or unterminated call is content, tags included."""

    def __init__(self) -> None:
        self.buf, self.in_call = "", False

    def feed(self, text: str) -> list:
        self.buf += text
        events: list = []
        while True:
            if not self.in_call:
                at = self.buf.find(OPEN)
                if at < 0:
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                                 if OPEN.startswith(self.buf[-k:])), 0)
                    if len(self.buf) > keep:
                        events.append(self.buf[: len(self.buf) - keep])
                        self.buf = self.buf[len(self.buf) - keep:]
                    return events
                if at:
                    events.append(self.buf[:at])
                self.buf, self.in_call = self.buf[at + len(OPEN):], True
            else:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return events
                body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE):], False
                call = _hermes_body(body)
                events.append(call if call is not None else OPEN + body + CLOSE)

    def finish(self) -> list:
        rest = (OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        return [rest] if rest else []


def parse_hermes(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The content (text outside well-formed calls) and the ``(name, arguments)`` calls of ``text``."""
    p = HermesParser()
    events = p.feed(text) + p.finish()
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, tuple)]


@dataclass
class ToolStream:
    """One choice's reply turned into content and calls as it arrives (see :meth:`delta`)."""

    plan: ToolPlan
    held: list[str] = field(default_factory=list)  # required / named: the whole output
    hermes: HermesParser = field(default_factory=HermesParser)
    sent: int = 0  # the calls sent so far

    def feed(self, text: str) -> list:
        if self.plan.mode == "auto":
            return self.hermes.feed(text)
        self.held.append(text)
        return []

    def finish(self) -> list:
        if self.plan.mode == "auto":
            return self.hermes.finish()
        text = "".join(self.held)
        try:
            value = json.loads(text)
        except ValueError:
            return [text] if text else []  # cut short: the text is the content
        if self.plan.mode == "named":
            return [(self.plan.name, json.dumps(value, ensure_ascii=False))]
        if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
            return [text]
        return [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]

    def delta(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """A streamed chunk's content and ``tool_calls`` deltas for its ``text`` (``final``:
        the choice's last chunk, everything held back is decided)."""
        events = self.feed(text) + (self.finish() if final else [])
        calls: list[dict] = []
        for e in events:
            if isinstance(e, tuple):
                c = _call(*e)
                calls.append({"index": self.sent, "id": c["id"], "type": "function",
                              "function": {"name": e[0], "arguments": ""}})
                calls.append({"index": self.sent, "function": {"arguments": e[1]}})
                self.sent += 1
        return "".join(e for e in events if isinstance(e, str)), calls


def finish_reason(reason: Any, has_calls: bool) -> Any:
    """``"tool_calls"`` for a reply that stopped with calls; else the engine's (wire) reason."""
    return "tool_calls" if has_calls and reason == "stop" else reason
