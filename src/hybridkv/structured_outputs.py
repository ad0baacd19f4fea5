"""What a request's output must match: vLLM's ``StructuredOutputsParams``, torch-free.

    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    StructuredOutputsParams(json_object=True)          # any JSON object (OpenAI's json_object)
    StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    StructuredOutputsParams(choice=["yes", "no"])
    StructuredOutputsParams(grammar='start: "a"+')      # llguidance's Lark dialect

Exactly one of ``json``, ``json_object`` (True), ``regex``, ``choice`` and ``grammar`` is set
(vLLM's rule and field names). ``whitespace_pattern`` (vLLM's) is a regex for the whitespace a
JSON output may hold between its tokens (None: llguidance's default, any JSON whitespace), and
``disable_any_whitespace`` (vLLM's) allows none; only with ``json`` or ``json_object``.

Values are kept hashable (a :class:`~hybridkv.sampling_params.SamplingParams` is): a schema
given as a dict is kept as its JSON text (key order kept: it is the order the properties are
generated in), a schema given as text is parsed and re-serialized the same way (so equal
schemas share one compiled grammar), ``choice`` as a tuple. A bad shape is an
InvalidArgumentError naming ``structured_outputs``; whether a schema, regex or grammar
compiles is the engine's check (:mod:`hybridkv.engine.structured`), made when the request is
added, before anything is queued.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import InvalidArgumentError

__all__ = ["KINDS", "StructuredOutputsParams"]

#: the constraint fields, one of which is set
KINDS = ("json", "json_object", "regex", "choice", "grammar")
PARAM = "structured_outputs"
_FLAGS = ("whitespace_pattern", "disable_any_whitespace")


def _bad(why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"structured_outputs: {why}", param=PARAM)


def _schema_text(schema: Any) -> str:
    """A JSON schema (a dict, a bool, or their JSON text) as compact JSON text, key order kept."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise _bad(f"json is not valid JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        return _json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _bad(f"json is not JSON-serializable ({exc})") from None


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output (see the module docstring)."""

    #: a JSON schema: given as a dict (or bool) or its JSON text; kept as compact JSON text
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    #: a Lark grammar in llguidance's dialect (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)
    grammar: str | None = None
    whitespace_pattern: str | None = None
    #: no whitespace at all between a JSON output's tokens (vLLM's flag)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise _bad(f"json_object must be a bool, got {self.json_object!r:.60}")
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise _bad(f"set exactly one of {', '.join(KINDS)}; got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(f"{name} must be a non-empty string, got {value!r:.60}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, (str, bytes)) or not hasattr(choice, "__iter__"):
                raise _bad(f"choice must be a list of strings, got {choice!r:.60}")
            choice = tuple(choice)
            if not choice or not all(isinstance(c, str) for c in choice):
                raise _bad(f"choice must be a non-empty list of strings, got {self.choice!r:.60}")
            object.__setattr__(self, "choice", choice)
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise _bad(f"whitespace_pattern must be a non-empty string, got {self.whitespace_pattern!r:.60}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _bad(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r:.60}")
        if (self.whitespace_pattern is not None or self.disable_any_whitespace) and self.json is None and not self.json_object:
            raise _bad("whitespace_pattern and disable_any_whitespace apply to json and json_object only")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise _bad("give whitespace_pattern or disable_any_whitespace, not both")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`KINDS`."""
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    @classmethod
    def from_dict(cls, body: Any) -> "StructuredOutputsParams":
        """vLLM's ``structured_outputs`` request field (``{"json": {...}}``, ``{"regex": "..."}``,
        ...); unknown keys are an InvalidArgumentError naming ``structured_outputs``."""
        if not isinstance(body, dict):
            raise _bad(f"must be an object, got {type(body).__name__}")
        unknown = sorted(set(body) - set(KINDS) - set(_FLAGS))
        if unknown:
            raise _bad(f"unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(KINDS + _FLAGS)}")
        return cls(**{k: v for k, v in body.items() if v is not None})
