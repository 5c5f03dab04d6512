"""Compiling grammars under a budget, once per distinct grammar (llguidance).

A client's JSON schema becomes a grammar the worker must compile before the first token,
and a hostile one can be costly: huge (`anyOf` of thousands of branches), with an empty
language (`{"$ref": "#"}`), or with only infinite words (a required property that
recursively requires itself). So:
- llguidance's own limits bound the work (`LIMITS`): grammar size and lexer fuel when
  compiling, lexer fuel and Earley items per decode step. `verbose_errors` is off:
  verbose messages carry the whole grammar, megabytes for a big schema, into logs and
  error messages.
- A wall-clock budget (`timeout`): compiling runs on its own thread (llguidance drops the
  GIL while it builds); a caller that waits longer than the budget gets a GrammarError.
  The build goes on in the background within llguidance's limits and caches its result,
  so a retry of the same schema is answered at once.
- Validation before any token: the first mask is computed at compile time, so a grammar
  that admits nothing is refused here, as a 400, instead of ending as empty "success".
- An LRU of compiled matchers keyed by the grammar's text: a repeated schema costs a
  `deep_copy` (well under a millisecond) instead of a compile. Failures are cached too.

Nothing here calls MLX: the preparation thread compiles while the MLX thread decodes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

from protocol.messages import INVALID_REQUEST
from worker.errors import RequestError

log = logging.getLogger("worker.grammar")

COMPILE_TIMEOUT = 10.0      # s a request waits for its grammar to compile
CACHE_ENTRIES = 64
CACHE_CHARS = 8_000_000     # grammar text kept compiled, in all (a proxy for their memory)
# llguidance's limits (its defaults, named here so that they are visible, except
# verbose_errors). Per step: ~15 ms of lexer work and ~2.5 ms of Earley items at most.
LIMITS = dict(
    max_items_in_row=2000,         # branching of one grammar row (anyOf width)
    initial_lexer_fuel=1_000_000,  # building the lexer's regexes (~20 ms)
    step_lexer_fuel=200_000,       # lexer work per mask
    step_max_items=50_000,         # Earley items per mask
    max_lexer_states=250_000,      # lexer DFA states (~1-2 kB each)
    max_grammar_size=500_000,      # symbols in the grammar
    verbose_errors=False,
)
_MESSAGE_LIMIT = 300


class GrammarError(RequestError):
    """A constraint that cannot be built or followed; the message is safe to show (a 400).
    Raised before the first token (a 400 response) or mid-decode (an error event)."""

    def __init__(self, message: str, param: str):
        super().__init__(INVALID_REQUEST, message, param)


class _Entry(NamedTuple):
    matcher: object          # a validated LLMatcher at its start; None on failure
    error: Optional[str]     # why it cannot be used (safe to show)


class _Build:
    __slots__ = ("done", "entry")

    def __init__(self):
        self.done = threading.Event()
        self.entry: Optional[_Entry] = None


class Compiler:
    """Budgeted, cached compilation of Lark grammars for one model's tokenizer."""

    def __init__(self, ll_tokenizer: Callable[[], object], vocab_size: int, *,
                 timeout: float = COMPILE_TIMEOUT, entries: int = CACHE_ENTRIES,
                 chars: int = CACHE_CHARS):
        self._ll_tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self.timeout = timeout
        self._entries, self._chars_max = entries, chars
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._chars = 0
        self._running: dict[str, _Build] = {}
        self.builds = 0  # compilations started: cache misses
        self.hits = 0

    def matcher(self, lark: str, param: str):
        """A fresh LLMatcher for `lark`, at its start. Raises GrammarError (a 400)."""
        tokenizer = self._ll_tokenizer()  # may raise GrammarError: a slow tokenizer
        with self._lock:
            entry = self._cache.get(lark)
            if entry is not None:
                self._cache.move_to_end(lark)
                self.hits += 1
            else:
                build = self._running.get(lark)
                if build is None:  # else the same grammar is compiling already: wait for it
                    build = self._running[lark] = _Build()
                    self.builds += 1
                    threading.Thread(target=self._build, args=(lark, tokenizer, build),
                                     name="grammar-compile", daemon=True).start()
        if entry is None:
            if not build.done.wait(self.timeout):
                log.warning("a grammar (%d chars) took over %g s to compile", len(lark),
                            self.timeout)
                raise GrammarError(f"the {param} grammar is too complex: compiling it took "
                                   f"longer than {self.timeout:g} s", param)
            entry = build.entry
        if entry.error is not None:
            raise GrammarError(entry.error, param)
        return entry.matcher.deep_copy()

    # ---- the compile thread -----------------------------------------------------------

    def _build(self, lark: str, tokenizer, build: _Build) -> None:
        try:
            entry = self._compile(lark, tokenizer)
        except Exception as e:  # llguidance raises only on API misuse; never leave a waiter
            log.exception("compiling a grammar failed")
            entry = _Entry(None, f"the grammar could not be compiled ({type(e).__name__})")
        with self._lock:
            self._running.pop(lark, None)
            self._remember(lark, entry)
        build.entry = entry
        build.done.set()

    def _compile(self, lark: str, tokenizer) -> _Entry:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark),
                                       log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            return _Entry(None, f"invalid schema or grammar: {clean(matcher.get_error())}")
        # The first mask: a grammar with no word to generate fails (or stops) right here.
        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self.vocab_size))
        if matcher.is_error() or matcher.is_stopped():
            why = clean(matcher.get_error()) or "it only admits empty output"
            return _Entry(None, f"the schema or grammar admits no output that can be "
                                f"generated: {why}")
        return _Entry(matcher, None)

    def _remember(self, lark: str, entry: _Entry) -> None:
        """Insert into the LRU (lock held), evicting the least recently used."""
        if len(lark) > self._chars_max:
            return
        self._cache[lark] = entry
        self._chars += len(lark)
        while len(self._cache) > self._entries or self._chars > self._chars_max:
            old, _ = self._cache.popitem(last=False)
            self._chars -= len(old)


def clean(message: str) -> str:
    """An llguidance error message for a client: no marker, one paragraph, bounded."""
    message = message.replace("<non-verbose/>", "").strip()
    return message if len(message) <= _MESSAGE_LIMIT else message[:_MESSAGE_LIMIT] + "…"
