"""Chat prompts: OpenAI messages and tools → the model's chat template → token ids.

Tools go to the template (`tools=`), which renders them the family's way. History is
rendered back the way templates expect it: an assistant turn's `tool_calls[].function.
arguments` arrive as a JSON string (OpenAI's wire form) but templates index or `tojson`
them as a mapping, so they are decoded; `tool` turns keep their `tool_call_id`.
`reasoning_effort` maps onto the template's own switch: passed through to templates that
take it (gpt-oss), else onto `enable_thinking` ("none"/"minimal" → off) for templates that
have that; explicit `chat_template_kwargs` win.
"""

from __future__ import annotations

import json

from protocol.messages import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, INVALID_REQUEST
from worker.errors import RequestError

# Rendering for models without a chat template (what mlx-lm's server does).
_FALLBACK_ROLES = {
    "system": "ASSISTANT's RULE: ",
    "user": "USER: ",
    "assistant": "ASSISTANT: ",
}
_FALLBACK_PREAMBLE = ("A chat between a curious user and an artificial intelligence "
                      "assistant. The assistant follows the given rules no matter what.\n")
_NO_THINKING = ("none", "minimal")


def _plain_content(content, media: tuple = ()):
    """OpenAI content may be a list of parts; only text parts are supported here, and
    {"type": "image"} / {"type": "audio"} parts for a model that reads them (`media`,
    the part types): then a list with its media is kept as parts, as multimodal
    templates read it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if media and isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in media for p in content):
        return [{"type": p["type"]} if isinstance(p, dict) and p.get("type") in media
                else {"type": "text", "text": _plain_content([p])} for p in content]
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


# A media part a model does not read: its noun, what it stands as in the history, and
# what the client may do instead.
_UNREAD = {"image": ("images", IMAGE_PLACEHOLDER, "ask a vision model"),
           "audio": ("audio", AUDIO_PLACEHOLDER, "ask a model that hears audio")}


def _media_as_text(parts: list, where: str, answering: bool, media: tuple) -> list:
    """A model's view of content parts it cannot read (not in `media`): each a
    placeholder, or a 400 when it is in the turn being answered."""
    out = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in _UNREAD or kind in media:
            out.append(p)
            continue
        noun, stand_in, instead = _UNREAD[kind]
        if answering:
            raise RequestError(INVALID_REQUEST, f"{where}: this model cannot read {noun}. "
                               f"Send text, or {instead}.", f"{where}.content")
        out.append({"type": "text", "text": stand_in + ("\n" if j < len(parts) - 1 else "")})
    return out


def _template_call(call) -> dict:
    """An assistant's past tool call as templates read it: arguments as a mapping."""
    if not isinstance(call, dict):
        return call
    call = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
        except ValueError:
            args = None
        if isinstance(args, dict):
            call["function"] = {**fn, "arguments": args}
    return call


def normalize_messages(messages, media: tuple = ()) -> list[dict]:
    """Messages as templates read them. A model given image or audio parts it does not
    read (not in `media`: a text model reads none) treats them as the API surfaces treat
    media no model here reads (supervisor/api/fields/media.py): in the last user turn a
    400, earlier a placeholder."""
    out = []
    last_user = max((i for i, m in enumerate(messages)
                     if isinstance(m, dict) and m.get("role") == "user"), default=-1)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(INVALID_REQUEST, "each message needs a string 'role'", "messages")
        m = dict(m)  # never mutate the request
        content = m.get("content")
        if isinstance(content, list):
            content = _media_as_text(content, f"messages[{i}]", i == last_user, media)
        m["content"] = _plain_content(content, media)
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def render_plain_chat(messages: list[dict]) -> str:
    text = _FALLBACK_PREAMBLE
    for m in messages:
        text += f"{_FALLBACK_ROLES.get(m['role'], '')}{m['content']}\n"
    return text + _FALLBACK_ROLES["assistant"].rstrip()


def template_kwargs(tokenizer, gen) -> dict:
    """Keyword arguments for apply_chat_template: tools, the thinking switch, and the
    client's chat_template_kwargs (last, so they win)."""
    kwargs: dict = {}
    if gen.output.tools:
        kwargs["tools"] = gen.output.tools
    effort = gen.output.reasoning_effort
    if effort is not None:
        source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        if "reasoning_effort" in source:
            kwargs["reasoning_effort"] = effort
        elif "enable_thinking" in source or tokenizer.has_thinking:
            kwargs["enable_thinking"] = effort not in _NO_THINKING
    kwargs.update(gen.template_kwargs or {})
    return kwargs


def chat_text(tokenizer, gen, media: tuple = ()) -> tuple[str, bool]:
    """The rendered chat prompt, and whether encoding it adds the tokenizer's special
    tokens. Rendering and encoding are apart so that the caller can judge the text's
    length before paying for its tokenization (worker/text/token_bound.py). `media`: the
    part types ("image", "audio") a multimodal model's template renders
    (worker/vision/engine.py)."""
    if not isinstance(gen.messages, list) or not gen.messages:
        raise RequestError(INVALID_REQUEST, "messages must be a non-empty list", "messages")
    messages = normalize_messages(gen.messages, media)
    if not tokenizer.has_chat_template:
        return render_plain_chat(messages), True
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True,
                                             **template_kwargs(tokenizer, gen))
    except Exception as e:
        # Templates reject conversations they cannot render (roles out of order,
        # unknown kwargs); their message explains it and holds no secrets.
        raise RequestError(INVALID_REQUEST, f"the chat template rejected the messages: {e}",
                           "messages") from None
    # What apply_chat_template(tokenize=True) does: encode the text, adding nothing.
    return text, False


def chat_ids(tokenizer, gen) -> list[int]:
    text, special = chat_text(tokenizer, gen)
    return list(tokenizer.encode(text, add_special_tokens=special))


def thinking_closed(tokenizer, ids: list[int]) -> bool:
    """Whether the template closed the think block itself at the end of the prompt (its
    thinking-off form, e.g. Qwen3's `<think>\n\n</think>\n\n`): then the model answers
    without thinking."""
    if not tokenizer.has_thinking:
        return True
    return tokenizer.rfind_think_end(ids, start=len(ids) - 11) >= 0


def starts_in_reasoning(tokenizer, ids: list[int]) -> bool:
    """Whether the prompt leaves the model inside a think block (the template opened
    one, as DeepSeek-R1 and Qwen3 thinking templates do): then the output starts as
    reasoning. (mlx-lm's server decides the same way.)"""
    if not tokenizer.has_thinking:
        return False
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)
