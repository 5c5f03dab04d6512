"""The text engine: prompt preparation and the per-sequence parts of generation (mlx-lm).

`prepare` turns a Generate into prompt token ids and checks it against the context
BEFORE any compute, raising RequestError with an OpenAI-style code and message; it also
builds the request's grammar (worker/text/constraints.py: a bad schema is a 400 here, before
any token) and its output splitter (worker/text/channels.py: reasoning and tool calls). It
calls no MLX, so it runs on the preparation thread (worker/loop/preparer.py) while the MLX
thread decodes; a prompt whose byte length alone proves it cannot fit is refused before
it is tokenized (worker/text/token_bound.py).

Generation itself is batched (worker/loop/batch.py, on mlx-lm's BatchGenerator); the engine
gives each sequence what is its own: its token budget, its sampler and logits processors
(worker/text/sampling.py) and its output handling (worker/text/decoding.py).

A failed step must not outlive its request: `recover()` reseeds the random key a failed
compiled sampler leaves without a primitive (worker/text/sampling.py), clears MLX's buffer
cache, and proves with a one-token probe that a step still runs; if it does not, the
caller recycles the worker.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from protocol.messages import (CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, Generate, ModelKind,
                               Task, unpack_ids)
from worker.text import prompt as chat_prompt
from worker.text import sampling
from worker.text import tokens
from worker.text import tool_formats
from worker.text.channels import REASONING, OutputSplitter
from worker.text.constraints import Constraint, GrammarError, Grammars
from worker.text.decoding import Decoding
from worker.errors import RequestError
from worker.text.token_bound import TokenBound
from worker.text.tokens import Answered

# Texts shorter than this are tokenized (~0.1 s at most) rather than judged by the bound.
_BOUND_MIN_CHARS = 100_000
SYSTEM_HEADS = 16  # distinct system prompts (and tools) whose tokens are kept
_PROBES = ("a", "Hello", "{", "1")  # different first user words: where renderings part
# Tokens: a system prompt's content end this close before its turn's end is not worth a
# state of its own beside it (`_system_end`).
_NEAR = 64


@dataclass
class Prepared:
    """A request checked and ready to generate: prompt ids and its output machinery."""
    gen: Generate
    ids: list
    constraint: Optional[Constraint] = None      # the grammar, if any
    splitter: Optional[OutputSplitter] = None    # reasoning / tool-call parsing, if any
    banned: tuple = ()                           # token ids never to sample
    snapshot: object = None                      # its `resume` state read from disk, if any
    media: Optional[dict] = None                 # a vision model's processed images (numpy)
    prediction: Optional[list] = None            # Predicted Outputs' text, as token ids
    marks: tuple = ()                            # prompt lengths worth a kept state (the
    #                                              system prompt's end: `keeps_system`)
    echo: Optional[list] = None                  # the prompt's logprob rows, once scored
    #                                              (worker/loop/echo.py)
    shared: bool = False                         # requests with its prompt wait for its
    #                                              state (worker/loop/batch.py `same`)

    def __len__(self) -> int:
        return len(self.ids)


class TextEngine:
    def __init__(self, model, tokenizer, context_length: int, prefill_step: int = 512,
                 vocab_size: int | None = None):
        self.model = model
        self.tokenizer = tokenizer  # mlx-lm TokenizerWrapper
        self.context_length = context_length
        self.prefill_step = max(1, prefill_step)
        self.vocab_size = vocab_size or len(tokenizer)
        self._eos = frozenset(tokenizer.eos_token_ids)
        self.tool_format = tool_formats.detect(tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.tool_format)
        self.bound = TokenBound(tokenizer)
        self._token_bytes: dict[int, bytes] = {}
        # Set at load where the KV cache cannot be trimmed (worker/loading/startup.py): a
        # chat's leading system prompt and tools are then a point whose state the KV cache
        # keeps (its `checkpoints`), so the next conversation with them starts there; a
        # trimmed state serves that by itself elsewhere.
        self.keeps_system = False
        self._system_heads: OrderedDict = OrderedDict()  # (`_system_end`'s)
        self._heads_lock = threading.Lock()  # (two preparation threads use them)

    # ---- preparation (no MLX compute) -----------------------------------------------

    def prepare(self, gen) -> Prepared | Answered:
        """Prompt ids for `gen`, checked against the context length, and the request's
        grammar and output splitter. Raises RequestError (shown to the client).
        Tokenize and detokenize are answered here, whole (worker/text/tokens.py)."""
        if gen.task is not Task.GENERATE:
            return tokens.answer(gen, self, ModelKind.TEXT)
        ids, param = self.prompt_ids(gen)
        max_tokens = gen.sampling.max_tokens
        if max_tokens is not None and max_tokens < (0 if gen.output.echo else 1):
            raise RequestError(INVALID_REQUEST, "max_tokens must be at least 1", "max_tokens",
                               len(ids))  # (0 with echo: the prompt alone, worker/loop/echo.py)
        # A ceiling only caps the budget (`budget`): the prompt alone must fit.
        self._check_context(len(ids), None if gen.sampling.max_tokens_ceiling else max_tokens,
                            param)
        sampling.check_logit_bias(gen.sampling, self.vocab_size)
        sampling.check_sampler_values(gen.sampling)
        return self._outputs(gen, ids)

    def prompt_ids(self, gen, bound: bool = True) -> tuple[list[int], str]:
        """The prompt's token ids, exactly as generation sees them (chat template, tools
        and template switches applied), and the parameter they came from. `bound`:
        refuse a text that cannot fit without tokenizing it."""
        max_tokens = None if gen.sampling.max_tokens_ceiling else gen.sampling.max_tokens
        if gen.messages is not None:
            param = "messages"
            text, special = chat_prompt.chat_text(self.tokenizer, gen)
            if bound:
                self._check_bound(text, max_tokens, param)
            ids = list(self.tokenizer.encode(text, add_special_tokens=special))
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
            if bound:
                self._check_bound(gen.prompt, max_tokens, param)
            # Like stream_generate: add BOS unless the prompt already starts with it (or
            # the request asks for the text's tokens alone).
            special = gen.special_tokens and (tok.bos_token is None
                                              or not gen.prompt.startswith(tok.bos_token))
            ids = tok.encode(gen.prompt, add_special_tokens=special)
        else:
            raise RequestError(INVALID_REQUEST, "a request needs messages or a prompt", "prompt")
        if not ids:
            raise RequestError(INVALID_REQUEST, "the prompt is empty", param)
        return list(ids), param

    def restart(self, prep: Prepared) -> Prepared:
        """The same request, to run again from its first token: a fresh grammar state
        and splitter (a compiled grammar comes from the cache: no compile again)."""
        return self._outputs(prep.gen, prep.ids)

    def turn_prefix(self, gen) -> list[int]:
        """The tokens every next turn of `gen`'s conversation begins with, whatever the
        template: the conversation rendered with different user messages after it, as far
        as the renderings agree (up to and including the opening of the user turn)."""
        renders = []
        for word in _PROBES:
            probe = Generate(rid=gen.rid, messages=[*gen.messages,
                                                    {"role": "user", "content": word}],
                             output=gen.output, template_kwargs=gen.template_kwargs)
            renders.append(self.prompt_ids(probe, bound=False)[0])
        return list(os.path.commonprefix(renders))  # (of any sequences, not only paths)

    def _system_end(self, gen, ids: list[int]) -> tuple:
        """Where in `ids` (a chat prompt's) a state is worth keeping for the next request
        with the same leading system messages and tools: where they end (`turn_prefix` of
        them alone, as far as it agrees with `ids`), and where the last one's content
        ends, if well before (a template that renders the tools after it), or instead,
        if near: a later request may carry more system text, as Codex's does. Its first
        request of a session is a warm-up (`generate: false`) of its instructions and
        tools alone; the turn that continues it adds a developer message, which joins
        the leading system message (supervisor/api/responses/items.py), so its prompt
        parts from the warm-up's where the instructions end: on a hybrid checkpoint 8,192
        of 12,828 tokens were read from the cache (a periodic state), the rest prefilled
        again. Nothing where there is no leading system message or the template refuses
        it alone. The renderings are kept per system prompt (SYSTEM_HEADS)."""
        messages = gen.messages if isinstance(gen.messages, list) else []
        lead = 0
        while lead < len(messages) and isinstance(messages[lead], dict) \
                and messages[lead].get("role") in ("system", "developer"):
            lead += 1
        if not lead:
            return ()
        key = json.dumps([messages[:lead], gen.output.tools, gen.output.reasoning_effort,
                          gen.template_kwargs], sort_keys=True, default=str)
        with self._heads_lock:
            heads = self._system_heads.get(key)
        if heads is None:
            heads = (self._rendered(gen, messages[:lead]),
                     self._rendered(gen, messages[:lead], appended=True))
            with self._heads_lock:
                self._system_heads[key] = heads
                while len(self._system_heads) > SYSTEM_HEADS:
                    self._system_heads.popitem(last=False)
        turn, content = (len(os.path.commonprefix([head, ids])) for head in heads)
        if content and turn - content < _NEAR:
            return (content,)
        return tuple(n for n in sorted({content, turn}) if n)

    def _rendered(self, gen, system: list, appended: bool = False) -> list[int]:
        """The tokens every request that begins with the messages `system` begins with:
        with different user messages after them (`turn_prefix`), or (`appended`) with
        different text appended to the last one's content, where it is a string; [] where
        the template refuses them."""
        try:
            if not appended:
                return self.turn_prefix(Generate(rid=gen.rid, messages=system,
                                                 output=gen.output,
                                                 template_kwargs=gen.template_kwargs))
            content = system[-1].get("content")
            if not isinstance(content, str):
                return []
            renders = [self.prompt_ids(Generate(
                rid=gen.rid, messages=[*system[:-1], {**system[-1],
                                                      "content": f"{content}\n\n{word}"}],
                output=gen.output, template_kwargs=gen.template_kwargs), bound=False)[0]
                for word in _PROBES[::2]]  # ("a", "{": a letter and a sign part at its end)
            return list(os.path.commonprefix(renders))
        except Exception:  # (a template that refuses the system messages alone)
            return []

    def _outputs(self, gen, ids: list[int]) -> Prepared:
        """The grammar and the splitter a request needs (none for plain completions)."""
        prep = Prepared(gen, ids)
        if self.keeps_system and gen.messages is not None:
            prep.marks = self._system_end(gen, ids)
        if getattr(gen, "prediction", None):
            prep.prediction = list(self.tokenizer.encode(gen.prediction,
                                                         add_special_tokens=False))
        out = gen.output
        chat = gen.messages is not None
        reasoning_first = chat and chat_prompt.starts_in_reasoning(self.tokenizer, ids)
        may_think = chat and not chat_prompt.thinking_closed(self.tokenizer, ids)
        try:
            prep.constraint = self.grammars.constraint(out, reasoning_first, may_think)
        except GrammarError as e:
            e.prompt_tokens = len(ids)
            raise
        fmt = self.tool_format
        calls = bool(out.tools) and out.tool_choice != "none"
        if chat and out.tools and out.tool_choice == "none" and fmt is not None and fmt.start:
            # "none" means no calls: the marker that opens one cannot be sampled.
            start = self.tokenizer.encode(fmt.start, add_special_tokens=False)
            if len(start) == 1:
                prep.banned = (start[0],)
        if chat and (self.tokenizer.has_thinking or (calls and fmt is not None)):
            prep.splitter = OutputSplitter(self.tokenizer, fmt if calls else None, out.tools,
                                           REASONING if reasoning_first else "normal")
        return prep

    def _check_bound(self, text: str, max_tokens: int | None, param: str) -> None:
        """Refuse, without tokenizing, a text whose byte length alone proves that it
        cannot fit (a lower bound on its tokens: worker/text/token_bound.py). Short texts are
        left to the exact count: it costs nothing and reports the real number."""
        if len(text) >= _BOUND_MIN_CHARS:
            self._check_context(self.bound.at_least(text), max_tokens, param, bound=True)

    def _check_context(self, n: int, max_tokens: int | None, param: str,
                       bound: bool = False) -> None:
        ctx = self.context_length
        where = "the messages" if param == "messages" else "the prompt"
        count = f"at least {n}" if bound else f"{n}"
        used = 0 if bound else n  # usage reports only what was really counted
        if max_tokens is None:
            if n >= ctx:
                raise RequestError(
                    CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {ctx} tokens. However, "
                    f"{where} resulted in {count} tokens, leaving no room for the "
                    f"completion. Please reduce the length of {where}.", param, used)
        elif n + max_tokens > ctx:
            raise RequestError(
                CONTEXT_LENGTH_EXCEEDED,
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {'at least ' if bound else ''}{n + max_tokens} tokens ({count} "
                f"in {where}, {max_tokens} in the completion). Please reduce the length of "
                f"{where} or completion.", param, used)

    def cap_context(self, tokens: int) -> None:
        """Serve at most `tokens` of context (what the KV budget holds for one sequence)."""
        self.context_length = max(1, min(self.context_length, tokens))

    # ---- per-sequence machinery (the batch runs it: worker/loop/batch.py) -------------------

    @property
    def eos(self) -> frozenset:
        return self._eos

    def budget(self, prep: Prepared) -> int:
        """Completion tokens at most: max_tokens, and what the context leaves."""
        budget = self.context_length - len(prep.ids)
        if prep.gen.sampling.max_tokens is not None:
            budget = min(budget, prep.gen.sampling.max_tokens)
        return max(1, budget)

    def sampler(self, prep: Prepared):
        return sampling.sampler_for(prep.gen.sampling, self.vocab_size)

    def processors(self, prep: Prepared) -> list:
        """Penalties, logit_bias and banned tokens (the grammar is added by the batch)."""
        return sampling.processors_for(prep.gen.sampling, prep.banned)

    def decoding(self, prep: Prepared) -> Decoding:
        return Decoding(self, prep, self.budget(prep))

    def token_bytes(self, tok: int) -> bytes:
        """A token's exact bytes (logprobs' `bytes`; may be part of a UTF-8 character)."""
        b = self._token_bytes.get(tok)
        if b is None:
            try:
                b = self.grammars.ll_tokenizer.decode_bytes([tok])
            except GrammarError:  # a slow tokenizer: its text is the best we have
                b = self.tokenizer.decode([tok]).encode("utf-8")
            self._token_bytes[tok] = b
        return b

    def recover(self) -> None:
        """After a request failed inside a step: drop what it may have left in MLX's
        global state, then prove that a step still runs. Raises if one does not (the
        worker then cannot serve, and must be replaced)."""
        sampling.reseed()  # a failed compiled sampler leaves the key without a primitive
        mx.clear_cache()
        self.probe()

    def probe(self) -> None:
        """A forward pass and a random (compiled) sample on a one-token prompt."""
        self._tiny_run(temperature=1.0, max_tokens=1)

    def _tiny_run(self, temperature: float, max_tokens: int) -> None:
        """A forward pass and a sample (mlx-lm's single-sequence generator, the plainest
        path through the model), outside any batch."""
        sampler = make_sampler(temperature)
        steps = generate_step(mx.array([0], dtype=mx.uint32), self.model, sampler=sampler,
                              max_tokens=max_tokens)
        for _ in steps:
            pass
