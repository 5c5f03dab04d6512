"""The text engine: prompt preparation and one generator per request (mlx-lm models).

`prepare` turns a Generate into prompt token ids and checks it against the context
BEFORE any compute, raising RequestError with an OpenAI-style code and message.
`generate` is one generator in the style of mlx-lm's `generate_step`/`stream_generate`:
it yields `None` after every prefill chunk (a point where the scheduler can cancel or
look at new commands) and one `(token, text, finish)` tuple per decode step.

The decode loop is the hot path. It keeps ONE step in flight (`mx.async_eval` of the next
step before `.item()` of the current one), so the Python work of a step (detokenizing,
stop strings, building the Delta) overlaps the computation of the next one. Per step it
does no logging, no extra syncs and as few allocations as it can.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, unpack_ids
from worker.stops import StopMatcher

# mlx-lm clears the buffer cache every 256 tokens: often enough to bound the cache,
# rarely enough to cost nothing measurable.
_CLEAR_CACHE_EVERY = 256

# Rendering for models without a chat template (what mlx-lm's server does).
_FALLBACK_ROLES = {
    "system": "ASSISTANT's RULE: ",
    "user": "USER: ",
    "assistant": "ASSISTANT: ",
}
_FALLBACK_PREAMBLE = ("A chat between a curious user and an artificial intelligence "
                      "assistant. The assistant follows the given rules no matter what.\n")


class RequestError(Exception):
    """A request the worker refuses; the message is safe to show to the client."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 prompt_tokens: int = 0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.prompt_tokens = prompt_tokens


def _plain_content(content) -> str:
    """OpenAI content may be a list of parts; only text parts are supported here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
                    and isinstance(p.get("text"), str)):
                raise RequestError(INVALID_REQUEST, "only text content parts are supported",
                                   "messages")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(INVALID_REQUEST, "message content must be a string or a list of parts",
                       "messages")


def _normalize_messages(messages) -> list[dict]:
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(INVALID_REQUEST, "each message needs a string 'role'", "messages")
        m = dict(m)  # never mutate the request
        m["content"] = _plain_content(m.get("content"))
        out.append(m)
    return out


def render_plain_chat(messages: list[dict]) -> str:
    text = _FALLBACK_PREAMBLE
    for m in messages:
        text += f"{_FALLBACK_ROLES.get(m['role'], '')}{m['content']}\n"
    return text + _FALLBACK_ROLES["assistant"].rstrip()


class TextEngine:
    def __init__(self, model, tokenizer, context_length: int, prefill_step: int = 512,
                 vocab_size: int | None = None):
        self.model = model
        self.tokenizer = tokenizer  # mlx-lm TokenizerWrapper
        self.context_length = context_length
        self.prefill_step = max(1, prefill_step)
        self.vocab_size = vocab_size or len(tokenizer)
        self._eos = frozenset(tokenizer.eos_token_ids)

    # ---- preparation (no MLX compute) -----------------------------------------------

    def prepare(self, gen) -> list[int]:
        """Prompt token ids for `gen`, checked against the context length."""
        if gen.messages is not None:
            param = "messages"
            ids = self._chat_ids(gen)
        elif gen.prompt_ids is not None:
            param = "prompt"
            ids = unpack_ids(gen.prompt_ids)
            bad = [i for i in ids if i >= self.vocab_size]
            if bad:
                raise RequestError(INVALID_REQUEST, f"token id {bad[0]} is out of range: the "
                                   f"vocabulary has {self.vocab_size} tokens", param)
        elif gen.prompt is not None:
            param = "prompt"
            tok = self.tokenizer
            # Like stream_generate: add BOS unless the prompt already starts with it.
            special = tok.bos_token is None or not gen.prompt.startswith(tok.bos_token)
            ids = tok.encode(gen.prompt, add_special_tokens=special)
        else:
            raise RequestError(INVALID_REQUEST, "a request needs messages or a prompt", "prompt")
        if not ids:
            raise RequestError(INVALID_REQUEST, "the prompt is empty", param)
        if gen.max_tokens is not None and gen.max_tokens < 1:
            raise RequestError(INVALID_REQUEST, "max_tokens must be at least 1", "max_tokens",
                               len(ids))
        self._check_context(len(ids), gen.max_tokens, param)
        return ids

    def _chat_ids(self, gen) -> list[int]:
        if not isinstance(gen.messages, list) or not gen.messages:
            raise RequestError(INVALID_REQUEST, "messages must be a non-empty list", "messages")
        messages = _normalize_messages(gen.messages)
        tok = self.tokenizer
        if not tok.has_chat_template:
            return tok.encode(render_plain_chat(messages))
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                          **(gen.template_kwargs or {}))
        except Exception as e:
            # Templates reject conversations they cannot render (roles out of order,
            # unknown kwargs); their message explains it and holds no secrets.
            raise RequestError(INVALID_REQUEST, f"the chat template rejected the messages: {e}",
                               "messages") from None
        return list(ids)

    def _check_context(self, n: int, max_tokens: int | None, param: str) -> None:
        ctx = self.context_length
        where = "the messages" if param == "messages" else "the prompt"
        if max_tokens is None:
            if n >= ctx:
                raise RequestError(
                    CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {ctx} tokens. However, "
                    f"{where} resulted in {n} tokens, leaving no room for the completion. "
                    f"Please reduce the length of {where}.", param, n)
        elif n + max_tokens > ctx:
            raise RequestError(
                CONTEXT_LENGTH_EXCEEDED,
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in {where}, {max_tokens} in the "
                f"completion). Please reduce the length of {where} or completion.", param, n)

    # ---- generation -------------------------------------------------------------------

    def generate(self, ids: list[int], gen):
        """Yield None per prefill chunk, then (token, text, finish) per decode step.

        token is -1 on the final step when it ends on EOS (no token to report; `text`
        may still carry text the detokenizer or the stop matcher held back). finish is
        None until the last yield, then "stop" or "length".
        """
        n = len(ids)
        budget = self.context_length - n
        if gen.max_tokens is not None:
            budget = min(budget, gen.max_tokens)
        temp = 1.0 if gen.temperature is None else gen.temperature
        sampler = make_sampler(temp, top_p=gen.top_p or 0.0, min_p=gen.min_p or 0.0,
                               top_k=gen.top_k or 0)
        rp = gen.repetition_penalty
        processors = make_logits_processors(repetition_penalty=rp) if rp not in (None, 1.0) else []
        if gen.seed is not None:
            mx.random.seed(gen.seed)  # one sequence at a time: this makes it reproducible

        model, stream, eos = self.model, generation_stream, self._eos
        cache = make_prompt_cache(model)
        prompt = mx.array(ids, dtype=mx.uint32)
        history = None  # the tokens the logits processors see (repetition penalty)

        def step(tokens):
            nonlocal history
            with mx.stream(stream):
                logits = model(tokens[None], cache=cache)[:, -1, :]
                if processors:
                    history = mx.concatenate([history, tokens])
                    for p in processors:
                        logits = p(history, logits)
                # Log-probabilities as mlx-lm samples them (top_p/min_p expect them).
                return sampler(logits - mx.logsumexp(logits, keepdims=True))

        # Prefill all but the last prompt token, one chunk per yield.
        pos, chunk = 0, self.prefill_step
        while n - pos > 1:
            k = min(chunk, n - pos - 1)
            with mx.stream(stream):
                model(prompt[pos:pos + k][None], cache=cache)
                mx.eval([c.state for c in cache])
            pos += k
            mx.clear_cache()
            yield None

        if processors:
            history = prompt[:pos]  # step() appends what it feeds the model
        y = step(prompt[pos:])
        mx.async_eval(y)

        detok = self.tokenizer.detokenizer
        stops = StopMatcher(gen.stop) if gen.stop else None
        produced = 0
        while True:
            produced += 1
            if produced < budget:
                next_y = step(y)
                mx.async_eval(next_y)
            tok = y.item()
            if tok in eos:
                detok.finalize()
                yield -1, self._tail(detok.last_segment, stops)[0], "stop"
                return
            detok.add_token(tok)
            text = detok.last_segment
            if stops is not None:
                text, hit = stops.feed(text)
                if hit:
                    yield tok, text, "stop"
                    return
            if produced >= budget:
                detok.finalize()
                tail, hit = self._tail(detok.last_segment, stops)
                yield tok, text + tail, "stop" if hit else "length"
                return
            yield tok, text, None
            if produced % _CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
            y = next_y

    @staticmethod
    def _tail(text: str, stops: StopMatcher | None) -> tuple[str, bool]:
        """The last text of a finished sequence: what the detokenizer flushed, through
        the stop matcher, plus whatever the matcher still held back."""
        if stops is None:
            return text, False
        text, hit = stops.feed(text)
        return (text, True) if hit else (text + stops.flush(), False)

    def warmup(self) -> None:
        """One tiny forward pass and a sample, so the first request pays no setup."""
        from protocol.messages import Generate

        for _ in self.generate([0], Generate(rid="warmup", prompt="", max_tokens=2,
                                             temperature=0.0)):
            pass
        mx.clear_cache()
