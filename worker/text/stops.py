"""Stop strings matched across token boundaries on the decoded text.

The model produces text in segments (one per decode step) that can split a stop string
anywhere, so the matcher holds back any tail of the pending text that could still grow
into a stop string and releases only text that can no longer be part of one. A stop
string is never returned: on a match only the text before it is emitted.

When several stop strings are complete at the same step, the output is cut at the one
that starts earliest (generation stops the first time any stop string appears).
"""

from __future__ import annotations


class StopMatcher:
    __slots__ = ("stops", "_hold", "_pending", "matched")

    def __init__(self, stops):
        # Empty strings would match everywhere; the supervisor validates, but be safe.
        self.stops = tuple(s for s in stops if s)
        # The longest text that can be held back: a proper prefix of the longest stop.
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a segment; return (text safe to emit now, matched). After a match the
        caller stops: the stop string and anything after it are dropped."""
        if not text:
            return "", False
        pending = self._pending + text
        cut = -1
        for s in self.stops:
            i = pending.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, self.matched = i, s
        if cut != -1:
            self._pending = ""
            return pending[:cut], True
        keep = self._held_suffix(pending)
        if keep:
            self._pending = pending[-keep:]
            return pending[:-keep], False
        self._pending = ""
        return pending, False

    def flush(self) -> str:
        """At the end of generation: the held-back text did not become a stop string."""
        out, self._pending = self._pending, ""
        return out

    def _held_suffix(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop."""
        for n in range(min(self._hold, len(pending)), 0, -1):
            tail = pending[-n:]
            for s in self.stops:
                if len(s) > n and s.startswith(tail):
                    return n
        return 0
