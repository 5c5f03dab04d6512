"""A Messages request body → a validated MessagesRequest → the protocol Generate.

Anthropic's shapes become the chat form the worker's templates render:
- `system` (a string or text blocks) → a system message first;
- user text blocks → the user message's text (joined by "\\n"); `tool_result` blocks → one
  `tool` message each (before the user's text, as they answer the previous turn), their
  content given as a string or as text blocks, `is_error` results prefixed "Error: ";
- assistant text → its content, `tool_use` blocks → its `tool_calls` (input as JSON
  text), `thinking` blocks → its `reasoning_content` (templates that keep past reasoning
  render it); `redacted_thinking` and server-tool blocks carry nothing a local model can
  read and are left out;
- a `compaction` block (compaction.py) → a user message holding its summary, where the
  turns it summarised were (a null one, a failed compaction's, is nothing);
- images and PDF documents: no model served here reads them yet; one in the last user
  message is a 400, earlier ones become "[image]" so a conversation can switch models;
  plain-text documents are read as text;
- `tools` ({name, description, input_schema}) → function tools; Anthropic's server tools
  (typed `web_search_...`, `bash_...`) cannot run here and are skipped, named in the
  X-MLXD-Warning header; `tool_choice` auto / any (→ required) / tool (→ required, that
  one) / none, `disable_parallel_tool_use` → one call at most;
- `thinking` enabled (its `budget_tokens` picks the effort: under 4096 low, under 16384
  medium, else high; the budget itself is not enforced token by token) / adaptive
  (medium) / disabled (none) → the template's reasoning switch; absent: the model's own
  default;
- `system` messages inside `messages` (Anthropic's mid-conversation system beta, which
  Claude Code sends): before any turn they join the system prompt; later ones go into the
  next user turn's text (many templates refuse a system message after the first turn);
- `stop_sequences`, `temperature` (0..1 as Anthropic allows), `top_p`, `top_k`;
  `max_tokens` is required, as Anthropic requires it (not for count_tokens), and is a
  ceiling: Claude Code asks for 32000 on every turn, and a model whose context leaves less
  generates what it leaves rather than refusing;
- `output_config.effort` picks the reasoning effort of adaptive thinking;
  `output_config.format` (`{"type": "json_schema", "schema": …}`, what the SDK's
  `messages.parse(output_format=…)` sends; the structured-outputs beta's top-level
  `output_format` too) → a JSON-schema response format: the reply's text follows the
  schema, grammar-enforced, as Anthropic's structured outputs guarantee.
`cache_control` markers, `metadata`, `service_tier` and unknown fields are accepted and
ignored: the prefix cache caches every prompt anyway.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import msgspec

from protocol.messages import Generate, Task
from supervisor.api.fields import generate as build
from supervisor.api.fields import tools as tooling
from supervisor.api.fields.limits import MAX_MESSAGES, check_length, check_parts, check_stop
from supervisor.api.fields.media import base64_image, last_user_index, media_part, resolve
from supervisor.api.fields.media import content as media_content
from supervisor.api.fields.params import (invalid_type, invalid_value, is_int, missing,
                                         opt_bool, opt_int, opt_number, opt_object, parse_model)
from supervisor.api.responses.seal import SUMMARY_HEADER
from supervisor.http.errors import APIError

MAX_STOP_SEQUENCES = 64
ROLES = ("user", "assistant", "system")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high", "xhigh": "high"}


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    messages: tuple                      # chat-form message dicts
    max_tokens: Optional[int]
    images: tuple = ()                   # image blocks' bytes, in order (fields/media.py)
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop: tuple = ()
    tools: tuple = ()                    # chat (nested) form
    tool_choice: tooling.ToolChoice = tooling.ToolChoice()
    response_format: tooling.ResponseFormat = tooling.ResponseFormat()
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    skipped_tools: tuple = field(default=())  # server tools left out (X-MLXD-Warning)

    def to_generate(self, config, task: Task = Task.GENERATE) -> Generate:
        gen = Generate(
            rid="",
            messages=[dict(m) for m in self.messages],
            images=resolve(self.images, config.allowed_media_dirs),
            sampling=build.sampling(config, max_tokens=self.max_tokens,
                                    temperature=self.temperature, top_p=self.top_p,
                                    top_k=self.top_k, max_tokens_ceiling=True),
            output=tooling.output(self.tools, self.tool_choice, self.response_format,
                                parallel_tool_calls=self.parallel_tool_calls,
                                stop=self.stop, reasoning_effort=self.reasoning_effort),
        )
        return gen if task is Task.GENERATE else msgspec.structs.replace(gen, task=task)


def parse_messages_request(body: dict, *, count_only: bool = False) -> MessagesRequest:
    """Validate a Messages body (count_tokens: `max_tokens` not required); raises
    APIError(400) naming what is wrong."""
    model = parse_model(body)
    max_tokens = opt_int(body, "max_tokens", minimum=1)
    if max_tokens is None and not count_only:
        raise missing("max_tokens")
    images: list[bytes] = []
    messages = _with_system(_system(body.get("system")), _messages(body.get("messages"), images))
    tools, skipped = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    opt_object(body, "metadata")
    return MessagesRequest(
        model=model,
        messages=tuple(messages),
        max_tokens=max_tokens,
        images=tuple(images),
        stream=bool(opt_bool(body, "stream")),
        temperature=opt_number(body, "temperature", 0, 1),
        top_p=opt_number(body, "top_p", 0, 1),
        top_k=opt_int(body, "top_k", minimum=0),
        stop=_stop_sequences(body.get("stop_sequences")),
        tools=tools,
        tool_choice=choice,
        response_format=_output_format(body),
        parallel_tool_calls=parallel,
        reasoning_effort=_thinking(body.get("thinking"), body.get("output_config")),
        skipped_tools=skipped,
    )


# ---- system and messages ---------------------------------------------------------------

def _system(value) -> list[dict]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    if not isinstance(value, list):
        raise invalid_type("system", "a string or an array of text blocks", value)
    texts = [_text_block(f"system[{i}]", b) for i, b in enumerate(value)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _messages(value, images: list) -> list[dict]:
    if value is None:
        raise missing("messages")
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        raise invalid_value("messages", "expected at least one message.", "empty_array")
    check_length("messages", value, MAX_MESSAGES)
    check_parts("messages", value)
    last_user = last_user_index(value)
    out: list[dict] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid_type(where, "an object", msg)
        role = msg.get("role")
        if role not in ROLES:
            if role is None:
                raise missing(f"{where}.role")
            raise invalid_value(f"{where}.role", f"{role!r}. Expected 'user', 'assistant' or "
                                "'system'.")
        blocks = _blocks(where, msg.get("content"))
        if role == "system":
            text = "\n".join(_text_block(f"{where}.content[{j}]", b)
                             for j, b in enumerate(blocks))
            out.append({"role": "system", "content": text})
            continue
        # A compaction block (compaction.py) stands for the turns it summarised: the
        # summary, as the user's words (templates open with a user turn).
        summaries = [_summary(f"{where}.content[{j}]", b) for j, b in enumerate(blocks)
                     if b["type"] == "compaction"]
        out.extend({"role": "user", "content": s} for s in summaries if s)
        blocks = [b for b in blocks if b["type"] != "compaction"]
        if role == "user":
            out.extend(_user(where, blocks, i == last_user, images))
        elif blocks or not summaries:
            out.append(_assistant(where, blocks))
    return out


def _with_system(system: list[dict], messages: list[dict]) -> list[dict]:
    """System messages from `messages` placed where every template takes them (in a user
    turn: many templates take a system message only first, some want user and assistant
    to alternate): those before the first turn join the system prompt; a later one joins
    the user message just before it, else the next user message (or, at the end, a user
    message of its own). Joined to the one before where there is one, so that the next
    request of the conversation renders it at the same place: Claude Code sends its
    environment as a system message after the first user message, and when it had
    joined the next user message the second turn moved it after the assistant's reply,
    its prompt parting from the first turn's after ~4,500 tokens (no prefix reuse)."""
    head = [m["content"] for m in system]
    out: list[dict] = []
    pending: list[str] = []
    for msg in messages:
        if msg["role"] == "system":
            if not out:
                head.append(msg["content"])
            elif out[-1]["role"] == "user" and not pending:
                out[-1] = {**out[-1], "content": _joined(out[-1]["content"], [msg["content"]])}
            else:
                pending.append(msg["content"])
            continue
        if pending and msg["role"] == "user":
            msg = {**msg, "content": _joined(pending, msg["content"])}
            pending = []
        out.append(msg)
    if pending:
        out.append({"role": "user", "content": "\n".join(pending)})
    return ([{"role": "system", "content": "\n".join(head)}] if head else []) + out


def _joined(*contents) -> str | list:
    """User contents (a string, texts, or parts with images) as one, in order."""
    pieces = []
    for c in contents:
        if isinstance(c, str):
            pieces.append(c)
        else:
            pieces.extend(p if isinstance(p, str) else p["text"] if p["type"] == "text"
                          else p for p in c)
    return media_content(pieces)


def _blocks(where: str, content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        raise missing(f"{where}.content")
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of content blocks", content)
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise invalid_type(f"{where}.content[{j}]", "an object", block)
        if not isinstance(block.get("type"), str):
            raise missing(f"{where}.content[{j}].type")
    return content


def _user(where: str, blocks: list[dict], images_refused: bool, images: list) -> list[dict]:
    """A user turn: its tool results (tool messages), then its text and images (a
    user message; with images, as parts: the worker's, supervisor/api/fields/media.py).
    Images inside tool results stay placeholders."""
    results, pieces = [], []  # pieces: texts and image parts, in order
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            pieces.append(_text_block(at, block))
        elif kind == "tool_result":
            results.append(_tool_result(at, block, images_refused))
        elif kind == "image":
            pieces.append(_image(at, block, images))
        elif kind == "document":
            pieces.append(_media(at, block, images_refused))
        elif kind in ("search_result", "container_upload"):
            raise invalid_value(f"{at}.type", f"{kind!r} blocks are not supported by this "
                                "server.", "unsupported_value")
        else:
            raise invalid_value(f"{at}.type", f"{kind!r} is not a user content block.")
    if pieces:
        return results + [{"role": "user", "content": media_content(pieces)}]
    return results


def _image(at: str, block: dict, images: list) -> dict:
    """An image block: base64 data travels to the worker; a URL source is refused."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid_type(f"{at}.source", "an object", source)
    if source.get("type") != "base64":
        raise APIError.bad_request(f"{at}.source: only base64 image sources are accepted "
                                   "(this server fetches no URLs and keeps no files).",
                                   f"{at}.source.type", "invalid_image_url")
    media_type, data = source.get("media_type"), source.get("data")
    if not isinstance(media_type, str) or not media_type.startswith("image/"):
        raise invalid_value(f"{at}.source.media_type", f"{media_type!r}: an image type is "
                            "needed (image/png, image/jpeg, image/gif, image/webp).")
    if not isinstance(data, str):
        raise invalid_type(f"{at}.source.data", "a string", data)
    return base64_image(at, data, images, f"{at}.source.data")


def _assistant(where: str, blocks: list[dict]) -> dict:
    texts, calls, reasoning = [], [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            texts.append(_text_block(at, block))
        elif kind == "tool_use":
            calls.append(_tool_use(at, block))
        elif kind == "thinking":
            text = block.get("thinking")
            if not isinstance(text, str):
                raise invalid_type(f"{at}.thinking", "a string", text)
            reasoning.append(text)
        elif kind in ("redacted_thinking", "server_tool_use", "web_search_tool_result",
                      "web_fetch_tool_result", "code_execution_tool_result"):
            continue  # nothing a local model can read
        else:
            raise invalid_value(f"{at}.type", f"{kind!r} is not an assistant content block.")
    msg: dict = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    return msg


def _summary(at: str, block: dict) -> Optional[str]:
    """A compaction block's summary, headed as the Responses API heads a compaction
    item's (seal.py); None for a failed compaction's (a no-op)."""
    content = block.get("content")
    if content is None:
        return None
    if not isinstance(content, str) or not content:
        raise invalid_value(f"{at}.content", "expected the summary's text, or null.")
    return SUMMARY_HEADER + content


def _text_block(at: str, block) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise invalid_value(at, "expected a text block ({\"type\": \"text\", \"text\": ...}).")
    text = block.get("text")
    if not isinstance(text, str):
        raise missing(f"{at}.text") if text is None else invalid_type(f"{at}.text", "a string",
                                                                       text)
    return text


def _tool_use(at: str, block: dict) -> dict:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise missing(f"{at}.id")
    if not isinstance(name, str) or not name:
        raise missing(f"{at}.name")
    if not isinstance(args, dict):
        raise invalid_type(f"{at}.input", "an object", args)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _tool_result(at: str, block: dict, images_refused: bool) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise missing(f"{at}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, inner in enumerate(content):
            where = f"{at}.content[{k}]"
            kind = inner.get("type") if isinstance(inner, dict) else None
            if kind in ("image", "document"):
                parts.append(_media(where, inner, images_refused))
            else:
                parts.append(_text_block(where, inner))
        text = "\n".join(parts)
    elif content is None:
        text = ""
    else:
        raise invalid_type(f"{at}.content", "a string or an array of content blocks", content)
    if opt_bool(block, "is_error", f"{at}.is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _media(at: str, block: dict, refused: bool) -> str:
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    if block["type"] == "document" and source.get("type") == "text":
        data = source.get("data")
        if not isinstance(data, str):
            raise invalid_type(f"{at}.source.data", "a string", data)
        return data
    return media_part(at, block["type"], refused)


# ---- tools, stops, thinking -----------------------------------------------------------

def _tools(value) -> tuple[tuple, tuple]:
    if value is None:
        return (), ()
    if not isinstance(value, list):
        raise invalid_type("tools", "an array", value)
    chat, skipped = [], []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise invalid_type(f"tools[{i}]", "an object", tool)
        kind = tool.get("type")
        if kind not in (None, "custom"):  # Anthropic's server tools: they run at Anthropic
            skipped.append(str(tool.get("name") or kind))
            continue
        schema = tool.get("input_schema")
        if schema is None:
            raise missing(f"tools[{i}].input_schema")
        if not isinstance(schema, dict):
            raise invalid_type(f"tools[{i}].input_schema", "an object", schema)
        fn = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            fn["description"] = tool.get("description")
        chat.append({"type": "function", "function": fn})
    try:
        return tooling.normalize_tools(chat), tuple(skipped)
    except APIError as e:  # named as this API names them: tools[i].name, not .function.name
        e.param = e.param.replace(".function.", ".") if e.param else e.param
        e.message = e.message.replace(".function.", ".")
        raise


def _tool_choice(value, tools: tuple) -> tuple[tooling.ToolChoice, Optional[bool]]:
    if value is None:
        return tooling.ToolChoice("auto"), None
    if not isinstance(value, dict):
        raise invalid_type("tool_choice", "an object", value)
    kind = value.get("type")
    parallel = opt_bool(value, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")
    parallel = None if parallel is None else not parallel
    if kind == "auto":
        return tooling.parse_tool_choice("auto", tools), parallel
    if kind == "none":
        return tooling.parse_tool_choice("none", tools), parallel
    if kind == "any":
        if not tools:
            raise invalid_value("tool_choice.type", "'any' needs at least one tool in 'tools'.")
        return tooling.parse_tool_choice("required", tools), parallel
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise missing("tool_choice.name")
        return tooling.parse_tool_choice({"type": "function", "name": name}, tools), parallel
    if kind is None:
        raise missing("tool_choice.type")
    raise invalid_value("tool_choice.type", f"{kind!r}. Expected 'auto', 'any', 'tool' or "
                        "'none'.")


def _output_format(body: dict) -> tooling.ResponseFormat:
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("format") is not None:
        value, param = config["format"], "output_config.format"
    else:
        value, param = body.get("output_format"), "output_format"
    if value is None:
        return tooling.ResponseFormat()
    if not isinstance(value, dict):
        raise invalid_type(param, "an object", value)
    kind = value.get("type")
    if kind is None:
        raise missing(f"{param}.type")
    if kind != "json_schema":
        raise invalid_value(f"{param}.type", f"{kind!r}. Expected 'json_schema'.")
    schema = value.get("schema")
    if schema is None:
        raise missing(f"{param}.schema")
    if not isinstance(schema, dict):
        raise invalid_type(f"{param}.schema", "an object", schema)
    return tooling.ResponseFormat("json_schema", schema, "output", True)


def _stop_sequences(value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid_type("stop_sequences", "an array of strings", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise invalid_value("stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop sequences.")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise invalid_value(f"stop_sequences[{i}]", "expected a non-empty string.")
        check_stop(f"stop_sequences[{i}]", s)
    return tuple(value)


def _thinking(value, output_config) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type("thinking", "an object", value)
    kind = value.get("type")
    if kind == "disabled":
        return "none"
    if kind == "adaptive":
        effort = output_config.get("effort") if isinstance(output_config, dict) else None
        return EFFORTS.get(effort, "medium")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if budget is None:
            raise missing("thinking.budget_tokens")
        if not is_int(budget) or budget < 1:
            raise invalid_value("thinking.budget_tokens", "expected a positive integer.")
        return "low" if budget < 4096 else "medium" if budget < 16384 else "high"
    if kind is None:
        raise missing("thinking.type")
    raise invalid_value("thinking.type", f"{kind!r}. Expected 'enabled', 'adaptive' or "
                        "'disabled'.")
