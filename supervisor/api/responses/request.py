"""POST /v1/responses bodies → ResponsesRequest (CreateResponse in OpenAI's spec).

Unknown fields are ignored; wrong types are 400s naming the field. Built-in tool types
(web_search, file_search, ...) cannot run here: they are skipped and named in the
`X-MLXD-Warning` response header instead of failing the request. Tools, tool_choice and
text.format go through the same parsers as chat completions (supervisor/api/fields/tools.py).
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Optional

from protocol.messages import Generate
from supervisor.api.conversations.request import conversation_id
from supervisor.api.fields import generate as build
from supervisor.api.fields.media import resolve, split
from supervisor.api.fields.params import (cache_key, invalid_type, invalid_value, missing,
                                         opt_bool, opt_int, opt_list, opt_number, opt_object,
                                         opt_str, parse_metadata, parse_model,
                                         parse_reasoning_effort)
from supervisor.api.responses.items import normalize_input, to_chat_messages
from supervisor.api.fields import tools as toolspec


@dataclass(frozen=True, kw_only=True)
class ResponsesRequest:
    model: str
    input_items: list                      # normalised (items.normalize_input)
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[str] = None     # its id (api/conversations/)
    resume_from: Optional[str] = None      # not the client's: the conversation's latest
    #                                        stored response (api/conversations/turns.py)
    stream: bool = False
    store: bool = True
    background: bool = False
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None   # -2..2, as chat completions takes them
    frequency_penalty: Optional[float] = None
    logprobs: bool = False                 # include: ["message.output_text.logprobs"]
    sealed_reasoning: bool = False         # include: ["reasoning.encrypted_content"]
    top_logprobs: int = 0                  # alternatives per token (0..20)
    tools: tuple = ()                      # function tools, normalised (chat's nested form)
    skipped_tools: list = field(default_factory=list)  # built-in tool types not run here
    # A `namespace` tool's functions are among `tools`, under their own names; their calls
    # name the namespace (FunctionToolCall.namespace).
    namespace_of: dict = field(default_factory=dict)       # function name → namespace
    tool_choice: toolspec.ToolChoice = field(default_factory=toolspec.ToolChoice)
    tool_choice_echo: object = "auto"      # as the client sent it, for the response object
    parallel_tool_calls: bool = True
    text_format: toolspec.ResponseFormat = field(default_factory=toolspec.ResponseFormat)
    text_format_echo: dict = field(default_factory=lambda: {"type": "text"})
    reasoning: Optional[dict] = None
    metadata: dict = field(default_factory=dict)
    prompt_cache_key: Optional[str] = None
    user: Optional[str] = None
    # Echoed, not applied: no built-in tool runs here (max_tool_calls counts only those),
    # no policy service reads a safety_identifier, no template takes a verbosity.
    max_tool_calls: Optional[int] = None
    safety_identifier: Optional[str] = None
    verbosity: str = "medium"              # text.verbosity (OpenAI's default)
    truncation: str = "disabled"           # "auto": cut to the window (truncation.py)
    compact_threshold: Optional[int] = None  # context_management: compact past this many
    #                                          prompt tokens (api/responses/summary.py)
    generate: bool = True  # False: a WebSocket mode warm-up (api/responses/websocket.py):
    #                        the prompt is prefilled and kept, no output is produced

    @property
    def reasoning_effort(self) -> Optional[str]:
        return (self.reasoning or {}).get("effort")

    @property
    def tools_echo(self) -> list:
        """The tools as the Responses API shows them (flat FunctionTool objects, a
        namespace's functions too: the Open Responses schema's ResponseResource knows no
        other tool)."""
        out = []
        for t in self.tools:
            fn = t["function"]
            tool = {"type": "function", "name": fn["name"],
                    "parameters": fn.get("parameters"), "strict": fn.get("strict")}
            if "description" in fn:
                tool["description"] = fn["description"]
            out.append(tool)
        return out

    def to_generate(self, items: list, config, response_id: str) -> Generate:
        """The request as the worker gets it (less its rid): the conversation `items`
        (a stored chain's, then this input's) as chat messages, with the server's
        defaults from `config` (supervisor/api/fields/generate.py). Its final KV state is
        kept under the response's id when the response is stored (else under its
        prompt_cache_key), and it resumes from its previous response's (or its
        conversation's latest, else the key's)."""
        media: list = []
        messages = to_chat_messages(items, self.instructions, media)
        images, audios = split(media)
        return Generate(
            rid="",
            messages=messages,
            images=resolve(images, config.allowed_media_dirs),
            audios=audios,
            # A warm-up prefills and keeps the state; the one token it must decode to do
            # so is dropped (runs.py).
            sampling=build.sampling(config, max_tokens=self.max_output_tokens
                                    if self.generate else WARM_UP_TOKENS,
                                    temperature=self.temperature, top_p=self.top_p,
                                    presence_penalty=self.presence_penalty,
                                    frequency_penalty=self.frequency_penalty),
            output=toolspec.output(self.tools, self.tool_choice, self.text_format,
                                parallel_tool_calls=self.parallel_tool_calls,
                                logprobs=self.logprobs, top_logprobs=self.top_logprobs,
                                reasoning_effort=self.reasoning_effort),
            cache=build.prompt_cache(self.prompt_cache_key,
                                     response_id=response_id if self.store else None,
                                     previous_response_id=(self.previous_response_id
                                                           or self.resume_from)),
        )


WARM_UP_TOKENS = 1


def parse_responses_request(body: dict) -> ResponsesRequest:
    model = parse_model(body)
    if "input" not in body or body["input"] is None:
        raise missing("input")
    items = normalize_input(body["input"])
    store = opt_bool(body, "store")
    background = bool(opt_bool(body, "background"))
    if background and store is False:
        raise invalid_value("background", "Background responses must be stored: "
                            "remove `store: false` or `background: true`.")
    tool_list, skipped, spaces = _split_tools(body)
    tools, namespace_of = _with_namespaces(toolspec.normalize_tools(tool_list), spaces)
    text = opt_object(body, "text") or {}
    fmt = text.get("format")
    top_logprobs = opt_int(body, "top_logprobs", 0, 20) or 0
    return ResponsesRequest(
        model=model,
        input_items=items,
        instructions=opt_str(body, "instructions"),
        previous_response_id=opt_str(body, "previous_response_id"),
        conversation=conversation_id(body),
        stream=bool(opt_bool(body, "stream")),
        store=store is not False,
        background=background,
        max_output_tokens=opt_int(body, "max_output_tokens", minimum=1),
        temperature=opt_number(body, "temperature", 0, 2),
        top_p=opt_number(body, "top_p", 0, 1, exclusive_minimum=True),
        presence_penalty=opt_number(body, "presence_penalty", -2, 2),
        frequency_penalty=opt_number(body, "frequency_penalty", -2, 2),
        logprobs=LOGPROBS in _include(body),
        sealed_reasoning=SEALED_REASONING in _include(body),
        top_logprobs=top_logprobs,
        tools=tools,
        skipped_tools=skipped,
        namespace_of=namespace_of,
        tool_choice=toolspec.parse_tool_choice(body.get("tool_choice"), tools),
        tool_choice_echo=body.get("tool_choice") or "auto",
        parallel_tool_calls=opt_bool(body, "parallel_tool_calls") is not False,
        text_format=toolspec.parse_response_format(fmt, "text.format"),
        text_format_echo=fmt or {"type": "text"},
        reasoning=_parse_reasoning(body),
        metadata=parse_metadata(body) or {},
        prompt_cache_key=cache_key(body),
        user=opt_str(body, "user"),
        max_tool_calls=opt_int(body, "max_tool_calls", minimum=0),
        safety_identifier=_safety_identifier(body),
        verbosity=_verbosity(text),
        truncation=_truncation(body),
        compact_threshold=_compact_threshold(body),
    )


def parse_side_request(body: dict) -> ResponsesRequest:
    """A Responses request as the routes beside POST /v1/responses read it (compact.py,
    counts.py): the same fields, `input` optional, never stored, streamed or run in the
    background, no `context_management`."""
    return parse_responses_request({**body, "input": body.get("input") or [], "store": False,
                                    "stream": False, "background": False,
                                    "context_management": None})


LOGPROBS = "message.output_text.logprobs"
SEALED_REASONING = "reasoning.encrypted_content"


def _include(body: dict) -> list:
    """`include`: strings. LOGPROBS and SEALED_REASONING (a reasoning item's text sealed
    in its `encrypted_content`, seal.py, for a client that keeps no state: Codex, the
    Vercel AI SDK with `store: false`) change the output here; the other values (the
    built-in tools' results) name nothing this server produces, so they are accepted and
    have no effect."""
    include = opt_list(body, "include") or []
    for i, value in enumerate(include):
        if not isinstance(value, str):
            raise invalid_type(f"include[{i}]", "a string", value)
    return include


def _split_tools(body: dict) -> tuple[list, list, list]:
    """(function tools, names of the built-in tool types that are skipped, the namespace
    tools as (where, name, their function tools))."""
    tools, skipped, spaces = [], [], []
    for i, tool in enumerate(opt_list(body, "tools") or []):
        if not isinstance(tool, dict):
            raise invalid_type(f"tools[{i}]", "an object", tool)
        kind = tool.get("type")
        if kind == "function":
            tools.append(tool)
        elif kind == "namespace":
            spaces.append(_namespace(f"tools[{i}]", tool, skipped))
        elif not isinstance(kind, str):
            raise invalid_type(f"tools[{i}].type", "a string", kind)
        elif _TOOL_TYPE.fullmatch(kind):
            skipped.append(kind)  # a built-in tool (web_search, ...): named in a header
        else:
            raise invalid_value(f"tools[{i}].type", f"'{kind[:64]}' is not a tool type.")
    return tools, skipped, spaces


def _namespace(where: str, tool: dict, skipped: list) -> tuple:
    """A `namespace` tool (NamespaceToolParam): its function tools (its custom ones are
    skipped, as top-level custom tools are)."""
    name, description = tool.get("name"), tool.get("description")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.name", "a non-empty string", name)
    if not isinstance(description, str):
        raise invalid_type(f"{where}.description", "a string", description)
    inner = tool.get("tools")
    if not isinstance(inner, list) or not inner:
        raise invalid_value(f"{where}.tools", "expected a non-empty array of tools.")
    functions = []
    for j, t in enumerate(inner):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            functions.append(t)
        elif kind == "custom":
            skipped.append(kind)
        else:
            raise invalid_value(f"{where}.tools[{j}].type", "expected 'function' or 'custom'.")
    return where, name, functions


def _with_namespaces(tools: tuple, spaces: list) -> tuple[tuple, dict]:
    """The top-level function tools and every namespace's, one list of distinct names;
    and the namespace of each of the latter."""
    names, namespace_of = toolspec.tool_names(tools), {}
    for where, space, functions in spaces:
        inner = toolspec.normalize_tools(functions, f"{where}.tools")
        for t in inner:
            name = t["function"]["name"]
            if name in names:
                raise invalid_value(f"{where}.tools", f"the function '{name}' is defined "
                                    "twice among the tools.")
            names.add(name)
            namespace_of[name] = space
        tools += inner
    return tools, namespace_of


# What OpenAI's tool types look like (web_search_preview_2025_03_11, mcp, ...). Only such
# names are skipped and echoed in the X-MLXD-Warning header: a header never carries text
# a client chose freely.
_TOOL_TYPE = re.compile(r"[a-z][a-z0-9_]{0,63}")


SUMMARIES = ("auto", "concise", "detailed")


VERBOSITIES = ("low", "medium", "high")
MAX_SAFETY_IDENTIFIER = 64  # characters (OpenAI's spec)


def _verbosity(text: dict) -> str:
    value = opt_str(text, "verbosity", "text.verbosity")
    if value is None:
        return "medium"
    if value not in VERBOSITIES:
        raise invalid_value("text.verbosity", f"'{value}'. Supported values are: "
                            + ", ".join(f"'{v}'" for v in VERBOSITIES) + ".")
    return value


TRUNCATIONS = ("auto", "disabled")


def _truncation(body: dict) -> str:
    value = opt_str(body, "truncation")
    if value is None:
        return "disabled"
    if value not in TRUNCATIONS:
        raise invalid_value("truncation", f"'{value}'. Supported values are: 'auto' and "
                            "'disabled'.")
    return value


def _safety_identifier(body: dict) -> Optional[str]:
    value = opt_str(body, "safety_identifier")
    if value is not None and len(value) > MAX_SAFETY_IDENTIFIER:
        raise invalid_value("safety_identifier", f"string too long. Expected a string with "
                            f"maximum length {MAX_SAFETY_IDENTIFIER}, but got a string with "
                            f"length {len(value)} instead.", "string_above_max_length")
    return value


def _parse_reasoning(body: dict) -> Optional[dict]:
    """`reasoning`: its effort, and whether a summary is asked for (`summary`, or the
    deprecated `generate_summary`): this server has no summarizer, so an item's reasoning
    is its own summary then (builder.py)."""
    reasoning = opt_object(body, "reasoning")
    if reasoning is None:
        return None
    effort = parse_reasoning_effort(reasoning, "effort", "reasoning.effort")
    summary = None
    for key in ("summary", "generate_summary"):
        value = opt_str(reasoning, key, f"reasoning.{key}")
        if value is not None and value not in SUMMARIES:
            raise invalid_value(f"reasoning.{key}", f"'{value}'. Supported values are: "
                                + ", ".join(f"'{v}'" for v in SUMMARIES) + ".")
        summary = summary or value
    return {"effort": effort, "summary": summary}


def _compact_threshold(body: dict) -> Optional[int]:
    """`context_management: [{"type": "compaction", "compact_threshold": N}]` → N (at
    least 1000, as OpenAI's spec says), or 0 for null (then 80% of the model's window).
    Other entry types are refused: this server knows only compaction."""
    threshold = None
    for i, entry in enumerate(opt_list(body, "context_management") or []):
        where = f"context_management[{i}]"
        if not isinstance(entry, dict):
            raise invalid_type(where, "an object", entry)
        if entry.get("type") != "compaction":
            raise invalid_value(f"{where}.type", "the only context management type is "
                                "'compaction'.")
        threshold = opt_int(entry, "compact_threshold", minimum=1000,
                            param=f"{where}.compact_threshold")
        threshold = 0 if threshold is None else threshold
    return threshold
