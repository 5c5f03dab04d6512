"""TextEngine in-process on the tiny random-weight model: determinism, limits, stops."""

from __future__ import annotations

import math

import pytest
from mlx_lm.generate import stream_generate

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, Generate, pack_ids
from tests.generates import generate
from worker.text.engine import TextEngine
from worker.errors import RequestError
from tests.worker.batchrun import steps as run_steps

PROMPT = "Once upon a time there was a little model"


def gen(**kw) -> Generate:
    kw.setdefault("rid", "t")
    if "messages" not in kw and "prompt_ids" not in kw:
        kw.setdefault("prompt", PROMPT)
    return generate(**kw)


def run(engine, g: Generate):
    """Run a request to the end: (prefill chunks, tokens, text, finish, steps)."""
    prep = engine.prepare(g)
    prefill, steps, gaps = 0, [], 0
    for out in run_steps(engine, prep):
        if out is None:
            if steps:
                # Only the step right after the first token may report none: the first
                # token was read as soon as it was computed (Batch._first_tokens), and
                # mlx-lm reports it again at the next step.
                assert len(steps) == 1 and not gaps, "a step without a token mid-decode"
                gaps += 1
                continue
            prefill += 1
            continue
        steps.append(out)
    assert steps and steps[-1][2] is not None, "the last step carries the finish reason"
    assert all(s[2] is None for s in steps[:-1])
    tokens = [t for t, *_ in steps if t >= 0]
    return prefill, tokens, "".join(s[1] for s in steps), steps[-1][2], steps


def test_greedy_is_deterministic_and_matches_mlx_lm(engine):
    g = gen(max_tokens=40, temperature=0.0)
    _, a, text_a, _, _ = run(engine, g)
    _, b, text_b, _, _ = run(engine, g)
    assert a == b and text_a == text_b
    assert len(a) == 40
    # The same tokens and text as mlx-lm's own generator (greedy is its default sampler).
    ids = engine.prepare(g).ids
    ref = list(stream_generate(engine.model, engine.tokenizer, ids, max_tokens=40))
    assert [r.token for r in ref] == a
    assert "".join(r.text for r in ref) == text_a


def test_seed_makes_sampling_reproducible(engine):
    runs = {s: run(engine, gen(max_tokens=30, temperature=1.0, seed=s))[1] for s in (1, 2)}
    assert run(engine, gen(max_tokens=30, temperature=1.0, seed=1))[1] == runs[1]
    assert runs[1] != runs[2]  # 30 samples from ~1000 tokens: equal only by freak chance


def test_sampling_options_run_and_respect_top_k(engine):
    # top_k=1 keeps only the most likely token: sampling degenerates to greedy.
    greedy = run(engine, gen(max_tokens=20, temperature=0.0))[1]
    assert run(engine, gen(max_tokens=20, temperature=1.5, top_k=1, seed=3))[1] == greedy
    _, toks, _, finish, _ = run(engine, gen(max_tokens=20, temperature=0.7, top_p=0.9,
                                            min_p=0.05, seed=4))
    assert len(toks) == 20 and finish == "length"


def test_repetition_penalty_changes_greedy_output(engine):
    plain = run(engine, gen(max_tokens=40, temperature=0.0))[1]
    penalized = run(engine, gen(max_tokens=40, temperature=0.0, repetition_penalty=3.0))[1]
    assert len(penalized) == 40
    # The random model repeats itself under greedy decoding; a strong penalty must not.
    assert len(set(plain)) < len(plain)
    assert penalized != plain


@pytest.mark.parametrize("n", [1, 7, 33])
def test_max_tokens_gives_exactly_that_many(engine, n):
    _, toks, _, finish, steps = run(engine, gen(max_tokens=n, temperature=0.0))
    assert len(toks) == len(steps) == n
    assert finish == "length"


def test_context_filling_up_ends_with_length(tiny_loaded):
    engine = TextEngine(tiny_loaded.model, tiny_loaded.tokenizer, 24, 64)
    g = gen(temperature=0.0)  # no max_tokens: whatever the context leaves
    n_prompt = len(engine.prepare(g))
    _, toks, _, finish, _ = run(engine, g)
    assert finish == "length" and len(toks) == 24 - n_prompt


class _NoCompute:
    def __call__(self, *a, **k):
        raise AssertionError("the model ran")


def test_context_check_happens_before_any_compute(tiny_loaded):
    engine = TextEngine(_NoCompute(), tiny_loaded.tokenizer, 16, 64)
    n_prompt = len(tiny_loaded.tokenizer.encode(PROMPT))
    with pytest.raises(RequestError) as e:
        engine.prepare(gen(max_tokens=17 - n_prompt))
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED and e.value.param == "prompt"
    assert "maximum context length is 16 tokens" in e.value.message
    assert f"you requested 17 tokens ({n_prompt} in the prompt" in e.value.message
    assert e.value.prompt_tokens == n_prompt
    # Exactly at the limit is fine.
    assert len(engine.prepare(gen(max_tokens=16 - n_prompt))) == n_prompt
    # Without max_tokens the prompt alone must leave room.
    with pytest.raises(RequestError) as e:
        engine.prepare(gen(prompt_ids=pack_ids(range(16))))
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED
    with pytest.raises(RequestError) as e:
        engine.prepare(gen(messages=[{"role": "user", "content": "word " * 20}], max_tokens=1))
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED and e.value.param == "messages"
    # A ceiling (Anthropic's max_tokens) only caps: the prompt alone must fit, and the
    # budget is what the context leaves.
    prep = engine.prepare(gen(max_tokens=32000, max_tokens_ceiling=True))
    assert len(prep) == n_prompt and engine.budget(prep) == 16 - n_prompt
    assert engine.budget(engine.prepare(gen(max_tokens=3, max_tokens_ceiling=True))) == 3
    with pytest.raises(RequestError) as e:
        engine.prepare(gen(prompt_ids=pack_ids(range(16)), max_tokens=5, max_tokens_ceiling=True))
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED


def test_prefill_takes_one_step_per_chunk(engine):
    # Each batch step prefills one chunk (so a Cancel or a new request is seen between
    # chunks); the step that moves the sequence from prefill to decoding gives its first
    # token (Batch._first_tokens reads it as soon as it is computed).
    ids = list(range(10, 310))  # 300 prompt tokens: 299 prefilled, the last one decodes
    prefill, toks, _, _, _ = run(engine, gen(prompt_ids=pack_ids(ids), max_tokens=3,
                                             temperature=0.0))
    assert prefill == math.ceil(299 / 64) == 5
    assert len(toks) == 3
    # A one-token prompt has nothing to prefill: its first step gives its first token.
    assert run(engine, gen(prompt_ids=pack_ids([5]), max_tokens=2))[0] == 0


def test_chunked_prefill_gives_the_same_tokens(tiny_loaded, engine):
    g = gen(prompt_ids=pack_ids(range(10, 210)), max_tokens=20, temperature=0.0)
    one_chunk = TextEngine(tiny_loaded.model, tiny_loaded.tokenizer, 4096, 4096)
    assert run(engine, g)[1] == run(one_chunk, g)[1]


def test_stop_string_is_never_returned(engine):
    _, toks, text, _, steps = run(engine, gen(max_tokens=60, temperature=0.0))
    # A stop string that greedy generation really produces and that spans a token
    # boundary: the end of one step's text and the start of the next one's.
    j = next(j for j in range(len(steps) // 2, len(steps) - 1)
             if len(steps[j][1]) >= 2 and len(steps[j + 1][1]) >= 2)
    stop = steps[j][1][-2:] + steps[j + 1][1][:2]
    cut = text.find(stop)
    _, toks2, text2, finish, _ = run(engine, gen(max_tokens=60, temperature=0.0,
                                                 stop=["never-there", stop]))
    assert finish == "stop"
    assert text2 == text[:cut]
    assert stop not in text2
    assert toks2 == toks[:len(toks2)] and len(toks2) < 60


def test_eos_stops_without_emitting_it(engine):
    _, toks, _, _, _ = run(engine, gen(max_tokens=30, temperature=0.0))
    k = next(i for i, t in enumerate(toks) if t not in toks[:i] and i >= 5)
    engine._eos = frozenset({toks[k]})  # pretend this token is the model's EOS
    _, toks2, _, finish, steps = run(engine, gen(max_tokens=30, temperature=0.0))
    assert finish == "stop"
    assert toks2 == toks[:k]
    assert steps[-1][0] == -1  # the EOS step reports no token


def test_chat_uses_the_chat_template(engine):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "text", "text": " there"}]}]
    ids = engine.prepare(gen(messages=messages, max_tokens=5)).ids
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        add_generation_prompt=True)
    assert ids == list(expected)
    assert engine.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert isinstance(messages[1]["content"], list)  # the request was not mutated


class _NoTemplate:
    """The tokenizer of a model that ships no chat template."""
    has_chat_template = False

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_chat_without_a_template_falls_back_to_plain_text(engine):
    engine.tokenizer = _NoTemplate(engine.tokenizer)
    ids = engine.prepare(gen(messages=[{"role": "user", "content": "Hello"}], max_tokens=5)).ids
    text = engine.tokenizer.decode(ids)
    assert "USER: Hello" in text and text.endswith("ASSISTANT:")


def test_invalid_requests(engine):
    cases = [
        gen(prompt=""),
        gen(prompt_ids=pack_ids([engine.vocab_size])),
        gen(prompt_ids=b""),
        gen(messages=[]),
        gen(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        gen(max_tokens=0),
    ]
    for g in cases:
        with pytest.raises(RequestError) as e:
            engine.prepare(g)
        assert e.value.code == INVALID_REQUEST, g


def test_prompt_ids_and_prompt_text_agree(engine):
    ids = engine.tokenizer.encode(PROMPT)
    a = run(engine, gen(max_tokens=10, temperature=0.0))[1]
    b = run(engine, gen(prompt_ids=pack_ids(ids), max_tokens=10, temperature=0.0))[1]
    assert a == b
