"""POST /v1/chat/completions: the request body → a validated ChatRequest.

Messages are normalized for the worker's chat template: `developer` becomes `system`
(templates know only system), content becomes one string (text parts joined with "\\n", as
vLLM does, so separate parts stay separate blocks), and every other key of a message
(name, tool_calls, tool_call_id, ...) is carried through untouched for the template.
Tools, tool_choice and response_format are validated by supervisor/api/fields/tools.py (shared
with the Responses API). Features the server cannot honour (images, audio, the
deprecated `functions`) are 400s naming the param, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from protocol.messages import Generate
from supervisor.api.fields import generate as build
from supervisor.api.fields import limits
from supervisor.api.fields import tools as tooling
from supervisor.api.fields.media import content as media_content
from supervisor.api.fields.media import (audio_part, image_part, last_user_index, media_part,
                                         resolve, split)
from supervisor.api.fields.params import (
    CommonParams, invalid_type, invalid_value, missing, opt_bool, opt_int, opt_list,
    opt_object, parse_common, parse_reasoning_effort, unsupported,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class ChatRequest(CommonParams):
    messages: tuple = ()                   # normalized message dicts
    images: tuple = ()                     # the image (audio) parts' bytes, in order
    #                                        (fields/media.py: AudioClips among them)
    parallel_tool_calls: Optional[bool] = None
    template_kwargs: Optional[dict] = None  # body's chat_template_kwargs (not OpenAI)
    tools: tuple = ()                      # nested chat form (tools.normalize_tools)
    tool_choice: tooling.ToolChoice = tooling.ToolChoice()
    response_format: tooling.ResponseFormat = tooling.ResponseFormat()
    logprobs: bool = False
    top_logprobs: int = 0
    reasoning_effort: Optional[str] = None
    prediction: Optional[str] = None       # Predicted Outputs' content (the worker drafts)

    def to_generates(self, config) -> list[Generate]:
        """lifecycle.run's prompts: the one (a legacy completion may send several)."""
        return [self.to_generate(config)]

    def to_generate(self, config) -> Generate:
        """The request as the worker gets it (less its rid), with the server's defaults
        from `config` (supervisor/api/fields/generate.py)."""
        images, audios = split(self.images)
        return Generate(
            rid="",
            messages=[dict(m) for m in self.messages],
            images=resolve(images, config.allowed_media_dirs),
            audios=audios,
            sampling=self.sampling(config),
            output=tooling.output(self.tools, self.tool_choice, self.response_format,
                                parallel_tool_calls=self.parallel_tool_calls,
                                stop=self.stop, logprobs=self.logprobs,
                                top_logprobs=self.top_logprobs,
                                reasoning_effort=self.reasoning_effort),
            template_kwargs=self.template_kwargs,
            cache=build.prompt_cache(self.prompt_cache_key),
            prediction=self.prediction,
        )


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a chat completions body; raises APIError(400) naming the bad param."""
    common = parse_common(body)
    messages, images = _parse_messages(body)
    # max_completion_tokens replaced max_tokens; honour either, the new one first.
    mct = opt_int(body, "max_completion_tokens", minimum=1)
    mt = opt_int(body, "max_tokens", minimum=1)
    _reject_unsupported(body)
    tools = tooling.normalize_tools(body.get("tools"))
    logprobs = bool(opt_bool(body, "logprobs"))
    top = opt_int(body, "top_logprobs", 0, 20)
    if top and not logprobs:
        raise invalid_value("top_logprobs", "'logprobs' must be true to use top_logprobs.")
    return ChatRequest(
        **common,
        max_tokens=mct if mct is not None else mt,
        messages=messages,
        images=images,
        parallel_tool_calls=opt_bool(body, "parallel_tool_calls"),
        template_kwargs=opt_object(body, "chat_template_kwargs"),
        tools=tools,
        tool_choice=tooling.parse_tool_choice(body.get("tool_choice"), tools),
        response_format=tooling.parse_response_format(body.get("response_format")),
        logprobs=logprobs,
        top_logprobs=top or 0,
        reasoning_effort=parse_reasoning_effort(body),
        prediction=_parse_prediction(body),
    )


def _parse_prediction(body: dict) -> Optional[str]:
    """Predicted Outputs: {"type": "content", "content": a string or text parts}, the
    text the answer is expected to mostly repeat (joined parts, as message content is)."""
    prediction = opt_object(body, "prediction")
    if prediction is None:
        return None
    if "type" not in prediction:
        raise missing("prediction.type")
    if prediction["type"] != "content":
        raise invalid_value("prediction.type", "the only supported type is 'content'.")
    content = prediction.get("content")
    if content is None:
        raise missing("prediction.content")
    if isinstance(content, str):
        return content or None
    if not isinstance(content, list) or not content:
        raise invalid_type("prediction.content", "a string or an array of text parts",
                           content)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise invalid_value(f"prediction.content[{i}]",
                                "expected a text part ({'type': 'text', 'text': ...}).")
        texts.append(part["text"])
    return "\n".join(texts) or None


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
    limits.check_length("messages", value, limits.MAX_MESSAGES)
    limits.check_parts("messages", value)
    last_user = last_user_index(value)
    images: list[bytes] = []
    messages = tuple(_parse_message(i, m, i == last_user, images) for i, m in enumerate(value))
    return messages, tuple(images)


def _parse_message(i: int, msg, last_user: bool = False, images: list | None = None) -> dict:
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

    content = _parse_content(where, role, msg, last_user, images)
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


# A user's media parts and the field each one's payload is in (OpenAI's shapes).
MEDIA_PARTS = {"image_url": "image_url", "input_audio": "input_audio", "file": "file"}


def _parse_content(where: str, role: str, msg: dict, last_user: bool = False,
                   images: list | None = None):
    """The message's text, or its parts when it holds an image: [{"type": "text",
    "text"}, {"type": "image"}, ...] (the image's bytes appended to `images`)."""
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
    pieces = []  # texts and image parts, in order (media.content joins them)
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_type(part_param, "an object", part)
        kind = part.get("type")
        if kind is None:
            raise missing(f"{part_param}.type")
        if not isinstance(kind, str):
            raise invalid_type(f"{part_param}.type", "a string", kind)
        if kind in MEDIA_PARTS and role == "user":
            pieces.append(_media_part(part_param, kind, part, last_user, images))
            continue
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
        pieces.append(text)
    return media_content(pieces)


def _media_part(at: str, kind: str, part: dict, last_user: bool, images: list | None):
    """An image, audio or file part of a user message, its shape checked: an image's or
    a clip's part for the worker (fields/media.py `image_part`, `audio_part`: the worker
    refuses what its model cannot read); files are placeheld in the history, a 400 in
    the turn being answered (no model here reads them)."""
    payload = part.get(MEDIA_PARTS[kind])
    if payload is None:
        raise missing(f"{at}.{MEDIA_PARTS[kind]}")
    if kind == "image_url":
        url = payload.get("url") if isinstance(payload, dict) else payload
        if not isinstance(url, str):
            where = f"{at}.image_url" + (".url" if isinstance(payload, dict) else "")
            raise invalid_type(where, "a string", url)
        return image_part(at, url, images if images is not None else [])
    if kind == "input_audio":
        return audio_part(at, payload, images if images is not None else [],
                          f"{at}.input_audio")
    if not isinstance(payload, dict):
        raise invalid_type(f"{at}.{MEDIA_PARTS[kind]}", "an object", payload)
    return media_part(at, kind, last_user)


# ---- features not served -----------------------------------------------------------

def _reject_unsupported(body: dict) -> None:
    if opt_list(body, "functions"):
        raise unsupported("functions", "The deprecated 'functions' parameter is not supported "
                          "by this server; use 'tools'.")
    value = body.get("function_call")
    if value is None or value in ("none", "auto"):
        return
    if isinstance(value, str):
        raise invalid_value("function_call", f"'{value}'. Supported values are: 'none', "
                            "'auto'.")
    if not isinstance(value, dict):
        raise invalid_type("function_call", "a string or an object", value)
    raise unsupported("function_call", "The deprecated 'function_call' parameter is not "
                      "supported by this server; use 'tool_choice'.")

