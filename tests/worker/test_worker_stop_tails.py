"""Text the stop matcher holds back (it could still become a stop string) comes out when
the sequence ends another way: by its token budget or by end-of-sequence
(worker/text/decoding.py's `_tail`, worker/text/stops.py's `flush`). The tiny model in-process: a
stop string made of the output's last characters plus one it never writes, so the
matcher holds those characters until the end."""

from __future__ import annotations

from tests.worker.test_worker_engine import gen, run

NEVER = "\x00"  # a character the model's text never holds (checked below)


def _stop_on_tail(text: str) -> str:
    assert len(text) >= 2 and NEVER not in text
    return text[-2:] + NEVER


def test_held_back_text_is_emitted_when_the_budget_ends_the_sequence(engine):
    _, toks, text, finish, _ = run(engine, gen(max_tokens=20, temperature=0.0))
    assert finish == "length"
    _, toks2, text2, finish2, steps = run(engine, gen(max_tokens=20, temperature=0.0,
                                                      stop=[_stop_on_tail(text)]))
    assert (toks2, finish2) == (toks, "length")
    assert text2 == text
    # The last two characters were held back until the last step.
    assert steps[-1][1].endswith(text[-2:])


def test_held_back_text_is_emitted_when_end_of_sequence_ends_it(engine):
    _, toks, _, _, _ = run(engine, gen(max_tokens=30, temperature=0.0))
    k = next(i for i, t in enumerate(toks) if t not in toks[:i] and i >= 8)
    engine._eos = frozenset({toks[k]})  # pretend this token is the model's EOS
    _, toks2, text, finish, _ = run(engine, gen(max_tokens=30, temperature=0.0))
    assert (toks2, finish) == (toks[:k], "stop")
    _, toks3, text3, finish3, steps = run(engine, gen(max_tokens=30, temperature=0.0,
                                                      stop=[_stop_on_tail(text)]))
    assert (toks3, finish3) == (toks[:k], "stop")
    assert text3 == text
    assert steps[-1][0] == -1 and steps[-1][1].endswith(text[-2:])  # the EOS step flushed
