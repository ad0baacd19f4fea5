"""``StopStringMatcher``: stop strings on streamed text, as vLLM / OpenAI apply them.

The output ends just before the first stop string to complete (the earliest end; of two that
end together, the longer); the stop string itself is not output. Text that might be the start
of a stop string is held back until the next ``feed`` settles it; ``flush()`` returns it at the
end of a stream that did not stop.

Worked example, stops ``["</s>", "\\n\\n"]``::

    feed("Hi<")      -> ("Hi", False)     '<' may start '</s>': held
    feed("/x")       -> ("</x", False)    no stop starts with '</x'
    feed("y\\n")     -> ("y", False)      '\\n' may start '\\n\\n': held
    feed("\\nmore")  -> ("", True)        stopped; '\\n\\n' and what follows are dropped

Usage::

    stops = StopStringMatcher(sampling.stop)
    text, stopped = stops.feed(detok.add(new_ids))
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.errors import InvalidArgumentError


class StopStringMatcher:
    def __init__(self, stops: str | Sequence[str] | None = ()):
        if stops is None:
            stops = ()
        elif isinstance(stops, str):
            stops = (stops,)
        if not isinstance(stops, Sequence):
            raise InvalidArgumentError(f"stop strings must be a str or a list of str, got {type(stops).__name__}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidArgumentError(f"a stop string must be a non-empty str, got {s!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._held = ""
        self.stopped = False
        self.stop: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text to emit, stopped)`` after ``text`` arrives; after a stop, always ``("", True)``."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"streamed text must be a str, got {type(text).__name__}")
        if self.stopped:
            return "", True
        buffer = self._held + text
        found = self._first_stop(buffer)
        if found is not None:
            start, self.stop = found
            self.stopped, self._held = True, ""
            return buffer[:start], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text (a partial stop string that never completed); '' after a stop."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """``(start, stop)`` of the stop string that completes first in ``buffer``, if any."""
        best = None
        for s in self.stops:
            start = buffer.find(s)
            if start >= 0:
                key = (start + len(s), start)
                if best is None or key < best[0]:
                    best = (key, s)
        return None if best is None else (best[0][1], best[1])

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
