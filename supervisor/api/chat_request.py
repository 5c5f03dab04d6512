"""POST /v1/chat/completions: the request body → a validated ChatRequest.

Messages are normalized for the worker's chat template: `developer` becomes `system`
(templates know only system), content becomes one string (text parts joined with "\\n", as
vLLM does, so separate parts stay separate blocks), and every other key of a message
(name, tool_calls, tool_call_id, ...) is carried through untouched for the template.
Features the server cannot honour yet (images, audio, tools, logprobs, JSON modes) are
400s naming the param, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from supervisor.api.params import (
    CommonParams, invalid_type, invalid_value, missing, opt_bool, opt_int, opt_list,
    opt_object, parse_common, unsupported,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class ChatRequest(CommonParams):
    messages: tuple = ()                   # normalized message dicts
    parallel_tool_calls: Optional[bool] = None
    template_kwargs: Optional[dict] = None  # body's chat_template_kwargs (not OpenAI)

    def to_generate_fields(self) -> dict:
        """Keyword arguments of protocol.messages.Generate, except rid and log_prompt."""
        return {
            "messages": [dict(m) for m in self.messages],
            "prompt": None,
            "prompt_ids": None,
            **self.sampling_fields(),
            "template_kwargs": self.template_kwargs,
        }


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a chat completions body; raises APIError(400) naming the bad param."""
    common = parse_common(body)
    messages = _parse_messages(body)
    # max_completion_tokens replaced max_tokens; honour either, the new one first.
    mct = opt_int(body, "max_completion_tokens", minimum=1)
    mt = opt_int(body, "max_tokens", minimum=1)
    _reject_unsupported(body)
    return ChatRequest(
        **common,
        max_tokens=mct if mct is not None else mt,
        messages=messages,
        parallel_tool_calls=opt_bool(body, "parallel_tool_calls"),
        template_kwargs=opt_object(body, "chat_template_kwargs"),
    )


# ---- messages ------------------------------------------------------------------------

def _parse_messages(body: dict) -> tuple:
    if body.get("messages") is None:
        raise missing("messages")
    value = body["messages"]
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        raise invalid_value("messages", "empty array. Expected an array with minimum "
                            "length 1, but got an empty array instead.", "empty_array")
    return tuple(_parse_message(i, m) for i, m in enumerate(value))


def _parse_message(i: int, msg) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise invalid_type(where, "an object", msg)
    role = msg.get("role")
    if role is None:
        raise missing(f"{where}.role")
    if not isinstance(role, str):
        raise invalid_type(f"{where}.role", "a string", role)
    if role == "function":
        raise unsupported(f"{where}.role", "The deprecated 'function' role is not supported "
                          "by this server; use 'tool' messages.", "unsupported_value")
    if role not in ROLES:
        raise invalid_value(f"{where}.role", f"'{role}'. Supported values are: "
                            + ", ".join(f"'{r}'" for r in ROLES) + ".")

    content = _parse_content(where, role, msg)
    if msg.get("name") is not None and not isinstance(msg["name"], str):
        raise invalid_type(f"{where}.name", "a string", msg["name"])
    if role == "tool":
        if msg.get("tool_call_id") is None:
            raise missing(f"{where}.tool_call_id")
        if not isinstance(msg["tool_call_id"], str):
            raise invalid_type(f"{where}.tool_call_id", "a string", msg["tool_call_id"])
    if role == "assistant":
        calls = opt_list(msg, "tool_calls", f"{where}.tool_calls")
        for j, call in enumerate(calls or ()):
            if not isinstance(call, dict):
                raise invalid_type(f"{where}.tool_calls[{j}]", "an object", call)

    return {**msg, "role": "system" if role == "developer" else role, "content": content}


def _parse_content(where: str, role: str, msg: dict) -> Optional[str]:
    param = f"{where}.content"
    content = msg.get("content")
    if content is None:
        if role == "assistant":  # a turn that only called tools
            return None
        if "content" not in msg:
            raise missing(param)
        raise invalid_type(param, "a string or an array of content parts", content)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(param, "a string or an array of content parts", content)
    if not content:
        raise invalid_value(param, "empty array. Expected an array with minimum length 1, "
                            "but got an empty array instead.", "empty_array")
    texts = []
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_type(part_param, "an object", part)
        kind = part.get("type")
        if kind is None:
            raise missing(f"{part_param}.type")
        if not isinstance(kind, str):
            raise invalid_type(f"{part_param}.type", "a string", kind)
        # An assistant turn the model refused is still what it said, for the template.
        key = "text" if kind == "text" else "refusal" if (
            kind == "refusal" and role == "assistant") else None
        if key is None:
            raise unsupported(f"{part_param}.type", f"Content parts of type '{kind}' are not "
                              "supported by this server yet; send text.", "unsupported_value")
        text = part.get(key)
        if not isinstance(text, str):
            if text is None:
                raise missing(f"{part_param}.{key}")
            raise invalid_type(f"{part_param}.{key}", "a string", text)
        texts.append(text)
    return "\n".join(texts)


# ---- features not served yet ---------------------------------------------------------

def _reject_unsupported(body: dict) -> None:
    if opt_bool(body, "logprobs"):
        raise unsupported("logprobs", "logprobs are not supported by this server yet.")
    if opt_int(body, "top_logprobs", 0, 20):
        raise unsupported("top_logprobs", "logprobs are not supported by this server yet.")

    for key in ("tools", "functions"):
        if opt_list(body, key):
            raise unsupported(key, "tools are not supported by this server yet.")
    _check_choice(body, "tool_choice", ("none", "auto", "required"))
    _check_choice(body, "function_call", ("none", "auto"))

    fmt = opt_object(body, "response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind is None:
            raise missing("response_format.type")
        if kind in ("json_object", "json_schema"):
            raise unsupported("response_format", f"response_format '{kind}' is not "
                              "supported by this server yet.", "unsupported_value")
        if kind != "text":
            raise invalid_value("response_format.type", f"'{kind}'. Supported values are: "
                                "'text', 'json_object', 'json_schema'.")


def _check_choice(body: dict, key: str, allowed: tuple) -> None:
    """Without tools only "none"/"auto" mean anything, and both mean "answer in text"."""
    value = body.get(key)
    if value is None or value in ("none", "auto"):
        return
    if isinstance(value, str):
        if value not in allowed:
            raise invalid_value(key, f"'{value}'. Supported values are: "
                                + ", ".join(f"'{a}'" for a in allowed) + ".")
    elif not isinstance(value, dict):
        raise invalid_type(key, "a string or an object", value)
    raise unsupported(key, "tools are not supported by this server yet.")

