"""Counting a JSON body's values as its bytes arrive, at C speed, without parsing it.

    counter = ValueCounter()
    for chunk in body_chunks:
        if counter.feed(chunk) > limit:   # commas outside strings so far
            refuse()

A JSON text with ``k`` commas outside its strings holds at least ``k + 1`` array elements
and object members together (every comma separates two of them). ``feed`` returns the
commas outside strings seen so far: a lower bound on the values a body carries that
needs no parse, so a body of 1.5M token ids is known to hold 1.5M values after its first
few chunks, long before ``json.loads`` would have built them. Strings (their escapes
included, split anywhere across chunks) are skipped by two compiled patterns; each chunk
costs a regex pass and ``bytes.count``, and nothing is kept but the state of one
unclosed string. Malformed JSON is counted as well as it can be; the parser refuses it
later.

Example: ``{"prompt": [1, 2, 3], "stop": ["a,b"]}`` fed as ``{"prompt": [1, 2`` and
``, 3], "stop": ["a,b"]}``: 1, then 3 (the comma inside ``"a,b"`` is not counted).
"""

from __future__ import annotations

import re

__all__ = ["ValueCounter"]

#: a whole string (escapes included), unrolled so that the scan never backtracks
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: the rest of a string already open: up to and including its closing quote
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


class ValueCounter:
    """Commas outside strings in the bytes fed so far (see the module docstring)."""

    __slots__ = ("commas", "_inside", "_escape")

    def __init__(self) -> None:
        self.commas = 0
        self._inside = False  # the last chunk ended inside a string
        self._escape = False  # ... right after a backslash that escapes the next byte

    def feed(self, chunk: bytes) -> int:
        """Count ``chunk``'s commas outside strings; the total so far."""
        data = b"\\" + chunk if self._escape else chunk
        self._escape = False
        start = 0
        if self._inside:
            m = _STRING_REST.match(data)
            if m is None:  # the string goes on past this chunk
                self._escape = _odd_backslashes(data)
                return self.commas
            start, self._inside = m.end(), False
        outside = _STRING.sub(b"", data[start:] if start else data)
        open_at = outside.find(b'"')
        if open_at >= 0:  # a string opens and does not close in this chunk
            self._inside = True
            self._escape = _odd_backslashes(outside[open_at + 1:])
            outside = outside[:open_at]
        self.commas += outside.count(b",")
        return self.commas


def _odd_backslashes(tail: bytes) -> bool:
    """Whether ``tail`` (inside a string) ends with an unpaired backslash (it escapes what comes next)."""
    return (len(tail) - len(tail.rstrip(b"\\"))) % 2 == 1
