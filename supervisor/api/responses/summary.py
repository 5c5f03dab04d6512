"""The model summarises a conversation: what a compaction item holds, for
POST /v1/responses/compact (compact.py) and for `context_management` on POST /v1/responses
(`start`: past its token threshold, a response compacts what came before it first).

The summary has to keep what an agent needs to go on: the task, the decisions, the files,
what is left. A small model (the `demo` model, SmolLM2-135M-Instruct, is what this prompt
was tried on) asked to summarise a conversation *it is in* answers the last message
instead ("I'm ready for your next question!"), or repeats one line until its budget ends.
So the model gets the conversation as a transcript inside one request ("a user and a
coding assistant said this: ..."), long items cut in their middle and the oldest dropped
to fit its window, greedy with a repetition penalty and a short budget; and what must not
depend on a small model's reading is written down, not generated: the user's first and
latest requests and the file paths the conversation names head the summary, the
model's notes follow.

Context management: when the prompt a response would prefill passes `compact_threshold`
tokens (counted by the worker: the tokenize task, exactly as generation renders it), the
model summarises the whole conversation, and the turn in progress (from the latest user
message on) is kept word for word inside the compaction item. The summary is the run's
first generation (runs.py), so a streaming client has `response.created` and
`response.in_progress` while it is written: OpenAI's specification has no event for a
compaction in progress, and its compaction item cannot be announced before its
`encrypted_content` exists, so the item comes whole (`output_item.added`, then `.done`)
once written, before the answer's items. The response's output then
starts with that item, the generation reads the summary and the kept turn, and a later
turn that continues the response (previous_response_id, a conversation, or the client's
own history) reads from the item on (seal.expand). The compacted prompt is a new prefix:
the generation resumes from no snapshot, and is kept under the response's id (or the
cache key) as usual, so the next turn resumes from the compacted state. The summarising
request (a transcript, a prefix of its own) neither resumes from a snapshot nor is kept
under a name. A prompt under its threshold but past the window (a `compact_threshold` the
client set above it) is cut with `truncation: "auto"` as any other (truncation.py), from
the count already made.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import msgspec
from aiohttp import web

from protocol.messages import Done, Generate, Task
from supervisor.api import lifecycle
from supervisor.api.fields import tools as toolspec
from supervisor.api.responses import truncation
from supervisor.api.responses.builder import ResponseBuilder
from supervisor.api.responses.items import text_of
from supervisor.api.responses.request import ResponsesRequest
from supervisor.api.responses.seal import SEALER, expand, summary_message
from supervisor.keys import CONFIG

SUMMARY_MAX_TOKENS = 160
DEFAULT_THRESHOLD = 0.8  # of the model's window, for a compact_threshold of null
REPETITION_PENALTY = 1.15
ITEM_CHARS = 1500        # a longer item (a tool's output, a pasted file) keeps its ends
CHARS_PER_TOKEN = 2.5    # a cautious guess (code and paths tokenize densely)
REQUEST_CHARS = 600      # the first and latest requests, as the summary quotes them
SUMMARY_INTRO = "Here is a conversation between a user and a coding assistant.\n\n"
SUMMARY_PROMPT = ("\n\nSummarize the conversation above in at most five sentences: what the "
                  "user wants, what was decided, which files were changed, and what is left "
                  "to do.")
# A small model goes on with the transcript instead of summarising it: the notes end
# where it starts a new turn of its own.
TURN_STOPS = ("\nuser:", "\nassistant:", "\ntool:")
# A file's path: with a folder, or a name with a common source or text extension.
_PATH = re.compile(r"(?<![\w/.-])(?:[\w.-]+/)+[\w.-]*\w|(?<![\w/.-])[\w-]+\.(?:py|js|ts|tsx|"
                   r"jsx|rs|go|c|h|cc|cpp|hpp|java|kt|rb|php|swift|sh|md|rst|txt|json|toml|"
                   r"yaml|yml|ini|cfg|html|css|sql|lock)\b")


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [...] {text[-half:]}"


def transcript_lines(items: list[dict]) -> list[str]:
    """The conversation as lines a model reads as a transcript, not as its own turn."""
    lines = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "user" if item["role"] in ("user", "system", "developer") else "assistant"
            text = text_of(item)
        elif kind == "function_call":
            role, text = "assistant", f"(calls {item['name']} {item['arguments']})"
        elif kind == "function_call_output":
            role, text = "tool", item["output"]
        else:
            continue  # reasoning: the assistant's own notes, not the conversation
        lines.append(f"{role}: {_cut(text.strip(), ITEM_CHARS)}")
    return lines


def _fit(lines: list[str], budget: int) -> list[str]:
    """The first line and as many of the latest as fit `budget` characters."""
    if not lines:
        return lines
    kept, used = [], len(lines[0])
    for line in reversed(lines[1:]):
        if used + len(line) > budget:
            break
        kept.append(line)
        used += len(line)
    return [lines[0]] + ([] if len(kept) == len(lines) - 1 else ["[...]"]) + kept[::-1]


def _clean(notes: str) -> str:
    """The model's notes less a transcript-style lead ("user: ") and repeated lines."""
    lines = []
    for line in notes.strip().splitlines():
        line = re.sub(r"^(user|assistant|tool):\s*", "", line.strip())
        if line and line not in lines:
            lines.append(line)
    return " ".join(lines)


def facts(items: list[dict]) -> str:
    """What the summary states whatever the model writes: the first and the latest
    user request, and the files the conversation names."""
    asks = [text_of(i).strip() for i in items
            if i["type"] == "message" and i["role"] == "user" and text_of(i).strip()]
    out = []
    if asks:
        out.append("Task: " + _cut(asks[0], REQUEST_CHARS))
        if len(asks) > 1 and asks[-1] != asks[0]:
            out.append("Latest request: " + _cut(asks[-1], REQUEST_CHARS))
    paths = []
    for line in transcript_lines(items):
        for path in _PATH.findall(line):
            if path not in paths and not path[0].isdigit():
                paths.append(path)
    if paths:
        out.append("Files: " + ", ".join(paths[:40]))
    return "\n".join(out)


def asking(config, runner, req: ResponsesRequest, items: list[dict],
           prompt: str = "") -> Generate:
    """The request that has the model summarise `items` (prompt items: compaction items
    already expanded); `prompt`, the client's own instructions in place of
    SUMMARY_PROMPT's (Anthropic's compaction takes them)."""
    ask = "\n\n" + prompt.strip() if prompt.strip() else SUMMARY_PROMPT
    window = runner.context_length or 4096
    budget = int((window - SUMMARY_MAX_TOKENS - 64) * CHARS_PER_TOKEN) - len(ask)
    text = "\n".join(_fit(transcript_lines(items), max(budget, 1000)))
    text = SUMMARY_INTRO + text + ask
    plain = dataclasses.replace(
        req, instructions=None, tools=(), tool_choice=toolspec.ToolChoice(),
        text_format=toolspec.ResponseFormat(), reasoning=None, store=False,
        max_output_tokens=SUMMARY_MAX_TOKENS, temperature=0.0, top_p=None,
        presence_penalty=None, frequency_penalty=None, logprobs=False, top_logprobs=0)
    prompt = [{"id": "summary", "type": "message", "role": "user", "status": "completed",
               "content": [{"type": "input_text", "text": text}]}]
    message = plain.to_generate(prompt, config, None)
    return msgspec.structs.replace(
        message, sampling=msgspec.structs.replace(message.sampling,
                                                  repetition_penalty=REPETITION_PENALTY),
        output=msgspec.structs.replace(message.output, stop=TURN_STOPS),
        # A transcript begins no snapshot, and nobody resumes from this one.
        cache=msgspec.structs.replace(message.cache, keep_as=None, resume_from=None,
                                      resume_label=""))


def written(items: list[dict], notes: str) -> str:
    """The summary of `items`: the facts, then the model's `notes`."""
    notes = _clean(notes)
    return "\n".join(p for p in (facts(items), notes and "Notes: " + notes) if p)


async def summarise(request: web.Request, runner, req: ResponsesRequest,
                    items: list[dict], prompt: str = "") -> tuple[str, Done]:
    """The summary of `items` and the usage of the request that wrote it."""
    gen = await lifecycle.queue(request, runner, asking(request.app[CONFIG], runner, req, items,
                                                        prompt))
    try:
        await gen.started()
        notes = "".join((await gen.collect()).text)
        done = gen.done
    finally:
        gen.close()
    return written(items, notes), done


@dataclass
class CompactingBuilder(ResponseBuilder):
    """A response whose output starts with the compaction item made for it; or, with
    `trigger` (a compaction_trigger ended its input: the sealer and the items before
    it), a response that is the compaction itself: the model's text becomes the item."""
    compaction: Optional[dict] = None
    trigger: Optional[tuple] = None
    notes: list = field(default_factory=list)
    # context_management past its threshold: the run's first generation is the summary;
    # its text → (the compaction item's events, the answer's Generation). runs.py.
    then: Optional[Callable[[str], Awaitable[tuple[list, lifecycle.Generation]]]] = None

    def start(self) -> list[dict]:
        events = super().start()
        if self.compaction is not None:
            events += self._item(self.compaction)
        return events

    def _item(self, item: dict) -> list[dict]:
        self.output.append(item)
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index, item=dict(item)),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def text(self, delta: str, item_id: str | None = None,
             logprobs: list | None = None) -> list[dict]:
        if self.trigger is None:
            return super().text(delta, item_id, logprobs)
        self.notes.append(delta)
        return []

    def finish(self, status: str, **kw) -> list[dict]:
        if self.trigger is None or status not in ("completed", "incomplete"):
            return super().finish(status, **kw)
        sealer, items = self.trigger  # a summary cut at its budget is still one
        events = self._item(sealer.item(written(items, "".join(self.notes))))
        return events + super().finish("completed", usage=kw.get("usage"))


def _turn_start(items: list[dict]) -> int:
    """Where the turn in progress starts: its latest user message (else the end)."""
    for i in range(len(items) - 1, -1, -1):
        if items[i]["type"] == "message" and items[i]["role"] == "user":
            return i
    return len(items)


async def start(request: web.Request, runner, req: ResponsesRequest,
                items: list[dict]) -> tuple[ResponseBuilder, Generate]:
    """A response's builder and the Generate it queues: `items` (the conversation) with
    its compaction items expanded; with `context_management` and a prompt past its
    threshold, compacted first (the builder then holds the compaction item); ended by a
    `compaction_trigger`, the summarising request itself (the response's one output
    item is the compaction item, after the user messages the client keeps, as
    /v1/responses/compact's)."""
    config = request.app[CONFIG]
    sealer = request.app[SEALER]
    items = expand(items, sealer)
    if items and items[-1]["type"] == "compaction_trigger":  # Codex's compaction
        builder = CompactingBuilder(req, runner.id, trigger=(sealer, items[:-1]))
        return builder, asking(config, runner, req, items[:-1])
    builder = CompactingBuilder(req, runner.id,  # (its id names the KV snapshot)
                                sealer=sealer if req.sealed_reasoning else None)
    message = req.to_generate(items, config, builder.id)

    async def fitted(count: int | None = None) -> Generate:  # (truncation "auto")
        return await truncation.fit(request, runner, req, items, message,
                                    lambda kept: req.to_generate(kept, config, builder.id),
                                    count)

    if req.compact_threshold is None:
        return builder, await fitted()
    counted = await lifecycle.compute(request, req.model,
                                      msgspec.structs.replace(message, task=Task.TOKENIZE))
    count = len(counted.result.id_list())
    threshold = req.compact_threshold or int(DEFAULT_THRESHOLD * (runner.context_length or 0))
    if count <= threshold:  # (a threshold past the window: under it, cut to fit it)
        return builder, await fitted(count)

    async def answer(notes: str) -> tuple[list, lifecycle.Generation]:
        summary = written(items, notes)
        kept = items[_turn_start(items):]
        builder.compaction = sealer.item(summary, kept, whole=True)
        message = req.to_generate([summary_message(builder.compaction["id"], summary)] + kept,
                                  config, builder.id)
        # A new prefix: no snapshot begins it; its final state is kept as usual.
        message = msgspec.structs.replace(
            message, cache=msgspec.structs.replace(message.cache, resume_from=None,
                                                   resume_label=""))
        gen = await lifecycle.queue(request, runner, message, {"max_tokens": "max_output_tokens"})
        return builder._item(builder.compaction), gen

    builder.then = answer
    return builder, asking(config, runner, req, items)
