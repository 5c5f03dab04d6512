"""A real trained model through mlxd: SmolLM2-135M-Instruct served as `demo`, its GGUF
converted by the worker on first load (tests/realmodel.py).

What random weights cannot show: greedy output equal to mlx-lm's own `generate`, replies
that end on the model's EOS, multi-byte text streamed from a real 49K-token BPE equal to
the non-streamed text, a JSON schema followed by a model that writes JSON, stop strings
cutting where the real text has them, a Responses chain that remembers, and the chat
template's default system prompt. Lean on purpose (this CPU runs the model at a few
tokens a second): short prompts, short budgets, one server for the module.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.integration.conftest import sse_events

pytestmark = pytest.mark.integration

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def capital(client):
    """The greedy answer to CAPITAL, with room to spare (the model ends it itself)."""
    return client.chat.completions.create(model="demo", messages=CAPITAL, temperature=0,
                                          max_tokens=24)


def test_the_server_says_the_model_is_real(real_server):
    _, body = real_server.get("/health")
    worker = body["workers"][0]
    assert worker["model"] == "demo" and worker["random_weights"] is False
    assert worker["context_length"] == 8192  # from the GGUF's llama.context_length


def test_greedy_output_equals_mlx_lm_generate(capital, real_mlx_lm):
    from mlx_lm import generate

    model, tokenizer = real_mlx_lm
    prompt = tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True)
    expected = generate(model, tokenizer, prompt, max_tokens=24)
    assert capital.choices[0].message.content == expected
    assert capital.usage.prompt_tokens == len(prompt)


def test_a_reply_ends_on_eos_with_stop(capital):
    choice = capital.choices[0]
    assert choice.finish_reason == "stop"
    assert capital.usage.completion_tokens < 24      # ended by the model, not the budget
    assert "Paris" in choice.message.content          # a trained model, not noise


def test_stop_string_cuts_where_the_greedy_text_has_it(client, capital):
    greedy = capital.choices[0].message.content
    cut = greedy[:greedy.index("Paris")]
    r = client.chat.completions.create(model="demo", messages=CAPITAL, temperature=0,
                                       max_tokens=24, stop=["Paris"])
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"


def test_streamed_multibyte_text_equals_the_non_streamed_text(real_server, client):
    body = {"model": "demo", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Repeat exactly: café, naïve, 日本語, 😀"}]}
    whole = client.chat.completions.create(**body).choices[0].message.content
    with httpx.Client(base_url=real_server.url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]]
    assert events[-1] == "[DONE]"
    assert "".join(pieces) == whole
    assert any(ord(ch) > 0x7F for ch in whole)  # the model answered in multi-byte text
    assert "\ufffd" not in whole                 # and no character was cut between tokens


def test_a_json_schema_reply_parses_and_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Describe a person."}],
        temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_the_templates_system_default_applies(client, real_mlx_lm):
    """No system message: the GGUF's template adds its own, which the prompt then holds;
    a system message of one's own replaces it."""
    _, tokenizer = real_mlx_lm
    user = [{"role": "user", "content": "Hi"}]
    default = client.chat.completions.create(model="demo", messages=user, max_tokens=1)
    rendered = (f"<|im_start|>system\n{SYSTEM_DEFAULT}<|im_end|>\n<|im_start|>user\nHi"
                "<|im_end|>\n<|im_start|>assistant\n")
    assert default.usage.prompt_tokens == len(tokenizer.encode(rendered))
    own = client.chat.completions.create(
        model="demo", messages=[{"role": "system", "content": "Be brief."}, *user], max_tokens=1)
    assert own.usage.prompt_tokens == len(tokenizer.encode(rendered.replace(SYSTEM_DEFAULT,
                                                                            "Be brief.")))


def test_the_responses_chain_continues_a_conversation(client):
    first = client.responses.create(model="demo", input="My name is Ana.", temperature=0,
                                    max_output_tokens=12)
    second = client.responses.create(model="demo", input="What is my name?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=12)
    assert "Ana" in second.output_text  # only the first turn said it
    # The second prompt holds the first turn: its input and the reply.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def _reference_rows(real_mlx_lm, ids: list[int]) -> list[tuple[float, float, int]]:
    """Per prompt token after the first, and for the token after the prompt: (its
    logprob, the best logprob, the best token) from one whole pass in this process."""
    import mlx.core as mx

    model, _ = real_mlx_lm
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    best = mx.argmax(lp, axis=-1).tolist()
    rows = [(lp[i - 1, ids[i]].item(), lp[i - 1].max().item(), best[i - 1])
            for i in range(1, len(ids))]
    return rows + [(lp[-1, best[-1]].item(), lp[-1].max().item(), best[-1])]


def test_echo_scores_a_prompt_as_an_evaluation_harness_reads_it(real_server, real_mlx_lm):
    """lm-evaluation-harness's loglikelihood request (token ids in a batch, `echo`,
    `logprobs: 1`, `max_tokens: 1`, temperature 0): each prompt token's logprob and the best
    alternative under the model, as one pass of the model in this process gives them, the
    first token's null; then the greedy next token, prefilled from the scored state."""
    _, tokenizer = real_mlx_lm
    texts = ["The capital of France is Paris", "Water boils at a temperature of 100 degrees"]
    prompts = [tokenizer.encode(t) for t in texts]
    with httpx.Client(base_url=real_server.url, timeout=120) as http:
        r = http.post("/v1/completions", json={
            "model": "demo", "prompt": prompts, "echo": True, "logprobs": 1,
            "max_tokens": 1, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for ids, choice in zip(prompts, body["choices"]):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt's, then the output's
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = _reference_rows(real_mlx_lm, ids)
        for i, (lp, best, best_id) in enumerate(expected, 1):
            assert logprobs["token_logprobs"][i] == pytest.approx(lp, abs=2e-3), i
            (top,) = logprobs["top_logprobs"][i].values()
            assert top == pytest.approx(best, abs=2e-3), i
        assert logprobs["tokens"][-1] == tokenizer.decode([expected[-1][2]])
        assert choice["text"] == tokenizer.decode(ids) + logprobs["tokens"][-1]
        assert logprobs["text_offset"][0] == 0
        # What the harness computes: the continuation's sum, and whether it was greedy.
        is_greedy = [t == max(top.values()) for t, top in
                     zip(logprobs["token_logprobs"][1:-1], logprobs["top_logprobs"][1:-1])]
        assert is_greedy == [lp == pytest.approx(best, abs=1e-6) or lp >= best
                             for lp, best, _ in expected[:-1]]
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)
    assert body["usage"]["completion_tokens"] == 2


def test_echo_without_logprobs_puts_the_prompt_before_the_same_output(client):
    kw = dict(model="demo", prompt="Once upon a time", max_tokens=6, temperature=0)
    plain = client.completions.create(**kw)
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)
    streamed = list(client.completions.create(**kw, echo=True, stream=True))
    assert streamed[0].choices[0].text == "Once upon a time"
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_a_completion_continues_its_prompts_text(client):
    """The output's first token keeps its leading space: it continues the prompt's text
    (mlx-lm's detokenizers drop it, as for a chat reply's first word); the text is its
    tokens' own, one after another."""
    r = client.completions.create(model="demo", prompt="The capital of France is",
                                  max_tokens=3, temperature=0, logprobs=0)
    text = r.choices[0].text
    assert text.startswith(" ") and text.strip(), text
    assert "".join(r.choices[0].logprobs.tokens) == text


def test_a_scored_continuation_the_model_would_end_keeps_its_last_token(real_server,
                                                                          real_mlx_lm):
    """After "Answer:" this model ends its turn: the one generated token is its EOS, whose
    row ends the logprobs (its text never in the output), so the harness's `[ctxlen:-1]`
    still covers the whole continuation."""
    _, tokenizer = real_mlx_lm
    ids = tokenizer.encode("Question: What is the capital of France?\nAnswer:")
    with httpx.Client(base_url=real_server.url, timeout=120) as http:
        body = http.post("/v1/completions", json={
            "model": "demo", "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}).json()
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    eos = _reference_rows(real_mlx_lm, ids)[-1]
    assert eos[2] in tokenizer.eos_token_ids  # the model's greedy next token: its EOS
    assert choice["finish_reason"] == "stop" and choice["text"] == tokenizer.decode(ids)
    assert len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["tokens"][-1] == tokenizer.decode([eos[2]])
    assert logprobs["token_logprobs"][-1] == pytest.approx(eos[0], abs=2e-3)
    assert body["usage"]["completion_tokens"] == 0


def test_echo_with_max_tokens_0_scores_the_prompt_alone(real_server, real_mlx_lm):
    """The spec's "prompt only" request (a text's perplexity): the prompt's rows, nothing
    generated; without echo, max_tokens 0 stays a 400."""
    _, tokenizer = real_mlx_lm
    ids = tokenizer.encode("The capital of France is Paris")
    with httpx.Client(base_url=real_server.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": "demo", "prompt": ids, "echo": True,
                                               "logprobs": 1, "max_tokens": 0})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids)
        for got, (want, _, _) in zip(logprobs["token_logprobs"][1:],
                                     _reference_rows(real_mlx_lm, ids)):
            assert got == pytest.approx(want, abs=2e-3)
        assert r.json()["usage"]["completion_tokens"] == 0
        assert http.post("/v1/completions", json={"model": "demo", "prompt": ids,
                                                  "max_tokens": 0}).status_code == 400
