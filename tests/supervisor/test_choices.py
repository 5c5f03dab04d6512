"""A request's choices (supervisor/api/choices.py): the Generates they fan out to, how
their usage adds up, and their output merged as it comes (over stand-in Generations; the
real ones run in tests/integration/test_choices.py)."""

from __future__ import annotations

import asyncio

import pytest

from protocol import Done, Generate
from protocol.messages import PromptCache, SamplingParams
from supervisor.api import choices
from supervisor.api.fields.params import INT64_MAX, INT64_MIN


def message(prompt: str, seed=None) -> Generate:
    return Generate(rid="", prompt=prompt, sampling=SamplingParams(seed=seed),
                    cache=PromptCache(namespace="k", keep_as="key:k", resume_from="key:k"))


def test_each_prompt_gets_n_choices_in_openais_order():
    out = choices.fan_out([message("a", seed=5), message("b", seed=INT64_MAX)], 3)
    assert [m.prompt for m in out] == ["a"] * 3 + ["b"] * 3
    assert [m.sampling.seed for m in out] == [5, 6, 7, INT64_MAX, INT64_MIN, INT64_MIN + 1]
    # Only a prompt's first choice keeps the snapshot; all resume from it and share its
    # namespace.
    assert [m.cache.keep_as for m in out] == ["key:k", None, None] * 2
    assert {(m.cache.namespace, m.cache.resume_from) for m in out} == {("k", "key:k")}
    # A prompt's first choice says how many repeats of its prompt follow: the worker
    # keeps the prompt's state for them (one prefill).
    assert [m.cache.repeats for m in out] == [2, 0, 0] * 2
    unseeded = choices.fan_out([message("a")], 2)
    assert [m.sampling.seed for m in unseeded] == [None, None]
    one = [message("a", seed=1)]
    assert choices.fan_out(one, 1) == one


def done(prompt, completion, cached=0, reasoning=0) -> Done:
    return Done(epoch=1, rid="r", finish_reason="stop", prompt_tokens=prompt,
                completion_tokens=completion, cached_tokens=cached,
                reasoning_tokens=reasoning)


def test_a_prompt_counts_once_and_completions_add_up():
    # Two prompts (10 and 20 tokens), two choices each.
    parts = choices.usage_parts([done(10, 3, cached=4), done(10, 5, cached=10),
                                 done(20, 1, reasoning=1), done(20, 2, cached=20)], 2)
    assert parts == {"prompt_tokens": 30, "cached_tokens": 4, "completion_tokens": 11,
                     "reasoning_tokens": 1, "accepted_prediction": 0,
                     "rejected_prediction": 0}


class Gen:
    """A stand-in Generation: its parts after the given delays; an exception ends it."""

    def __init__(self, *items):
        self.items = items
        self.closed = False

    async def parts(self, idle=None):
        for delay, item in self.items:
            await asyncio.sleep(delay)
            if isinstance(item, Exception):
                raise item
            yield item


async def collect(gens, idle=None):
    return [e async for e in choices.events(gens, idle)]


def test_the_choices_output_merged_as_it_comes():
    gens = [Gen((0.5, "a1"), (0.1, "a2")), Gen((0.0, "b1"), (0.01, "b2"))]
    got = asyncio.run(collect(gens))
    assert got == [(1, "b1"), (1, "b2"), (1, choices.END), (0, "a1"), (0, "a2"),
                   (0, choices.END)]


def test_quiet_choices_are_pinged_and_a_failure_ends_the_merge():
    gens = [Gen((5.0, "a1")), Gen((0.0, "b1"), (0.3, RuntimeError("worker gone")))]

    async def run():
        seen = []
        with pytest.raises(RuntimeError, match="worker gone"):
            async for event in choices.events(gens, idle=0.02):
                seen.append(event)
        return seen

    seen = asyncio.run(run())
    assert seen[0] == (1, "b1") and None in seen and (0, "a1") not in seen


def test_a_lone_choice_is_read_as_it_is():
    class Lone(Gen):
        async def parts(self, idle=None):
            yield "x"
            yield None  # (an idle ping, from the Generation itself)
            yield "y"

    assert asyncio.run(collect([Lone()])) == [(0, "x"), None, (0, "y"), (0, choices.END)]


def test_collecting_choices_cancels_the_others_when_one_fails():
    """A whole response: one choice's failure raises, and the other choices' reads end
    with it rather than wait on."""
    class Whole(Gen):
        ended = 0

        async def collect(self):
            try:
                return [p async for p in self.parts()]
            finally:
                Whole.ended += 1

    async def run():
        gens = [Whole((30.0, "late")), Whole((0.0, "x"), (0.05, RuntimeError("gone")))]
        with pytest.raises(RuntimeError, match="gone"):
            await choices.collect(gens)
        return Whole.ended

    assert asyncio.run(run()) == 2
    assert asyncio.run(choices.collect([Whole((0.0, "a")), Whole((0.0, "b"))])) == [["a"],
                                                                                     ["b"]]
