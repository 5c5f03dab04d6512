"""StopMatcher: stop strings across chunk boundaries, never returned."""

from __future__ import annotations

import itertools

import pytest

from worker.text.stops import StopMatcher


def run(stops, chunks):
    """Feed chunks like the engine does; return (emitted text, matched)."""
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        text, hit = m.feed(c)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def splits(text, parts):
    """Every way to cut `text` into `parts` consecutive (possibly empty) chunks."""
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = (0, *cuts, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("stop", ["END", "\n\n", "ab", "é✓"])
def test_stop_split_at_every_position(stop):
    text = f"hello {stop} world"
    for chunks in splits(text, 3):
        out, hit = run([stop], chunks)
        assert hit, chunks
        assert out == "hello ", chunks
        assert stop not in out


def test_text_without_stop_comes_out_whole():
    text = "abc ENx EN END? no: E N D"
    for chunks in splits(text, 3):
        out, hit = run(["END!"], chunks)
        assert (out, hit) == (text, False), chunks


def test_held_back_prefix_is_released_when_it_cannot_match():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)   # "ST" could still become STOP
    assert m.feed("O") == ("", False)             # "STO" too
    assert m.feed("P?") == ("", True)
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("ART") == ("START", False)      # not a stop after all: released
    assert m.flush() == ""


def test_flush_returns_what_was_held_back():
    m = StopMatcher(["</s>"])
    assert m.feed("x </") == ("x ", False)
    assert m.flush() == "</"
    assert m.flush() == ""


def test_multiple_stops_earliest_wins():
    assert run(["world", "lo w"], ["hello world"]) == ("hel", True)
    assert run(["b", "ab"], ["x", "a", "b"]) == ("x", True)
    # One stop is a prefix of another: the shorter completes first.
    assert run(["ab", "abc"], ["zab", "c"]) == ("z", True)


def test_the_earliest_start_wins_in_whatever_order_the_stops_are_listed():
    """Not the last one found nor merely one that starts elsewhere: both orders of each
    pair give the text before the earliest."""
    for stops in (["lo w", "world"], ["world", "lo w"]):
        m = StopMatcher(stops)
        assert m.feed("hello world") == ("hel", True) and m.matched == "lo w"
    for stops in (["ab", "b"], ["b", "ab"]):
        assert run(stops, ["x", "a", "b"]) == ("x", True)
    for stops in (["c", "ab", "bc"], ["bc", "ab", "c"]):
        m = StopMatcher(stops)
        assert m.feed("zabc") == ("z", True) and m.matched == "ab"


def test_the_matched_stop_is_named():
    """Done.stop_sequence (Anthropic's `stop_sequence`) comes from here."""
    m = StopMatcher(["world", "lo w", "zz"])
    assert m.matched is None
    first, hit = m.feed("hel")
    assert not hit and m.matched is None
    second, hit = m.feed("lo world")
    assert hit and first + second == "hel" and m.matched == "lo w"


def test_overlapping_prefix_inside_held_text():
    # "aab": after "aa" the matcher must keep "a" (the 2nd one) as a possible start.
    assert run(["ab"], ["a", "a", "b"]) == ("a", True)
    assert run(["aab"], ["a", "a", "a", "b"]) == ("a", True)
    assert run(["abab"], ["aba", "bab"]) == ("", True)


def test_stop_at_the_very_start_and_no_text():
    assert run(["Hi"], ["Hi there"]) == ("", True)
    m = StopMatcher(["x"])
    assert m.feed("") == ("", False)


def test_empty_stop_strings_are_ignored():
    assert run(["", "Z"], ["abc"]) == ("abc", False)
    assert run([""], ["abc"]) == ("abc", False)


def test_never_returned_for_random_chunking():
    import random

    rng = random.Random(0)
    stops = ["<|end|>", "###", "\nUser:"]
    for _ in range(300):
        body = "".join(rng.choice("ab#<|>\nUser:end ") for _ in range(rng.randint(0, 40)))
        chunks, i = [], 0
        while i < len(body):
            k = rng.randint(0, 5)
            chunks.append(body[i:i + k])
            i += k
        out, hit = run(stops, chunks)
        cut = min((body.find(s) for s in stops if s in body), default=-1)
        if cut == -1:
            assert (out, hit) == (body, False)
        else:
            # None of these stops contains another, so the first to complete is the
            # first to start: the output is exactly the text before it.
            assert (out, hit) == (body[:cut], True)
            assert not any(s in out for s in stops)
