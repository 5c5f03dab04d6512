"""Prompt lookup on the real `demo` model (SmolLM2-135M-Instruct), in the worker's batch:
a trained model returning a file it was shown repeats long runs of its prompt, so drafts
are accepted, and at temperature 0 the text is the one decoding gives without them, alone
and in a batch of four beside prose, a grammar-free plain request and a logit_bias one.

The request asks for the file back as it is: asked for an edit, this small model first
writes a sentence of its own (about 20 tokens that draft nothing), so the test needed 80
tokens to see 30 accepted; copying from its first token, 56 tokens accept about 39 drafts
in about 19 steps, and the test takes 0.7 x its time with the edit."""

from __future__ import annotations

import pytest

from tests.worker.test_speculative import ids, run, text

SOURCE = "\n".join(f"def step_{i}(values, scale={i}):\n    return sum(v * scale for v in "
                   f"values)  # step {i}\n" for i in range(5))
COPY = [{"role": "user", "content": "Repeat this Python code exactly:\n\n" + SOURCE}]
PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def demo_engine(real_model_dir):
    from worker.loading import models
    from worker.text.engine import TextEngine

    loaded = models.load(str(real_model_dir), real_model_dir.parent)
    return TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 512,
                      loaded.vocab_size)


def test_greedy_text_is_identical_with_prompt_lookup_alone_and_in_a_batch(demo_engine):
    edit = {"edit": dict(messages=COPY, max_tokens=56, temperature=0.0)}
    without, _, plain_steps = run(demo_engine, edit)
    with_, _, steps = run(demo_engine, edit, speculative="prompt-lookup")
    assert text(with_["edit"]) == text(without["edit"])
    assert run.totals.accepted > 30 and steps < plain_steps * 0.7
    # The batch: the edit's first 30 tokens (copied from its first) beside the others.
    four = {"edit": dict(messages=COPY, max_tokens=30, temperature=0.0),
            "prose": dict(messages=PROSE, max_tokens=30, temperature=0.0),
            "plain": dict(prompt="The capital of France is", max_tokens=10, temperature=0.0),
            "biased": dict(messages=COPY, max_tokens=30, temperature=0.0,
                           logit_bias=[(28, 1.5)])}
    without, _, _ = run(demo_engine, four)
    with_, _, _ = run(demo_engine, four, speculative="prompt-lookup")
    for name in four:
        assert ids(with_[name]) == ids(without[name]), name
    assert run.totals.accepted > 30
