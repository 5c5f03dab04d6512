"""Input items of the Responses API: normalised for storage, and turned into the chat
messages the worker templates.

Normalised items are what `GET /v1/responses/{id}/input_items` lists and what a later
`previous_response_id` replays: every item has an `id` and a `type`, message content is
always a list of parts.
"""

from __future__ import annotations

import uuid

from supervisor.api.fields.limits import MAX_MESSAGES, check_length, check_parts
from supervisor.api.fields.media import (audio_part, image_part, last_user_index, media_part,
                                         placeholder)
from supervisor.api.fields.params import invalid_type, invalid_value, unsupported

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")  # "text" is a common alias
# A user's media parts and the fields their payload may come in (OpenAI's shapes).
MEDIA_PARTS = {"input_image": ("image_url", "file_id"),
               "input_file": ("file_data", "file_id", "file_url"),
               "input_audio": ("input_audio",)}
IMAGE_DETAILS = ("low", "high", "auto", "original")
# The media parts that travel to the worker (fields/media.py), which refuses what its
# model cannot read.
TRAVELLING = ("input_image", "input_audio")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def normalize_input(value, param: str = "input") -> list[dict]:
    """`input` (a string or a list of items) → normalised items. 400 on anything else,
    naming `param` (a conversation's `items` are the same items)."""
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}])]
    if not isinstance(value, list):
        raise invalid_type(param, "a string or an array", value)
    check_length(param, value, MAX_MESSAGES)
    check_parts(param, value)
    items = [_item(f"{param}[{i}]", item) for i, item in enumerate(value)]
    for i, item in enumerate(items[:-1]):
        if item["type"] == "compaction_trigger":
            raise invalid_value(f"{param}[{i}].type", "a compaction_trigger must be the last "
                                "input item.")
    last = last_user_index(items)
    if last >= 0:  # files in the turn being answered: no model here reads them
        for j, part in enumerate(items[last]["content"]):
            if part["type"] in MEDIA_PARTS and part["type"] not in TRAVELLING:
                media_part(f"{param}[{last}].content[{j}]", part["type"], True)
    return items


def _message(role: str, content: list, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "role": role,
            "content": content, "status": status}


def _item(where: str, item) -> dict:
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    kind = item.get("type", "message")
    if kind == "message":
        return _parse_message(where, item)
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise invalid_type(f"{where}.{key}", "a string", item.get(key))
        call = {"id": item.get("id") or new_id("fc"), "type": "function_call",
                "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"], "status": "completed"}
        if isinstance(item.get("namespace"), str):  # a namespace tool's function
            call["namespace"] = item["namespace"]
        return call
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise invalid_type(f"{where}.call_id", "a string", item.get("call_id"))
        output = item.get("output")
        if isinstance(output, list):
            output = _tool_output(f"{where}.output", output)
        elif not isinstance(output, str):
            raise invalid_type(f"{where}.output", "a string or an array", output)
        return {"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                "call_id": item["call_id"], "output": output, "status": "completed"}
    if kind == "reasoning":
        # Accepted and replayed as assistant context; never a reason to fail. Its sealed
        # text, if any, is opened when the prompt is built (seal.py `expand`).
        out = {"id": item.get("id") or new_id("rs"), "type": "reasoning",
               "summary": [p for p in item.get("summary") or [] if isinstance(p, dict)],
               "content": [p for p in item.get("content") or [] if isinstance(p, dict)]}
        if isinstance(item.get("encrypted_content"), str):
            out["encrypted_content"] = item["encrypted_content"]
        return out
    if kind == "compaction":
        # Checked when the prompt is built (seal.py: only this server's open), kept as sent.
        if not isinstance(item.get("encrypted_content"), str):
            raise invalid_type(f"{where}.encrypted_content", "a string",
                               item.get("encrypted_content"))
        return {"id": item.get("id") or new_id("cmp"), "type": "compaction",
                "encrypted_content": item["encrypted_content"]}
    if kind == "compaction_trigger":  # compact what came before (summary.start)
        return {"id": item.get("id") or new_id("ct"), "type": "compaction_trigger"}
    if kind == "item_reference":
        raise unsupported(f"{where}.type", "Item references are not supported by this server; "
                          "send the item itself or use previous_response_id.")
    raise invalid_value(f"{where}.type", f"Invalid value: '{kind}'. Supported input item types "
                        "are: message, function_call, function_call_output, reasoning, compaction, "
                        "compaction_trigger.")


def _parse_message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise invalid_value(f"{where}.role", f"Invalid value: {role!r}. Supported values are: "
                            + ", ".join(f"'{r}'" for r in INPUT_ROLES) + ".")
    content = item.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [_part(f"{where}.content", {"type": part_type, "text": content}, role)]
    elif isinstance(content, list):
        parts = [_part(f"{where}.content[{j}]", p, role) for j, p in enumerate(content)]
    else:
        raise invalid_type(f"{where}.content", "a string or an array", content)
    return _message(role, parts, item.get("id"), item.get("status") or "completed")


def _part(where: str, part, role: str) -> dict:
    part_type = "output_text" if role == "assistant" else "input_text"
    if not isinstance(part, dict):
        raise invalid_type(where, "an object", part)
    kind = part.get("type")
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise invalid_type(f"{where}.text", "a string", part.get("text"))
        out = {"type": part_type, "text": part["text"]}
        if part_type == "output_text":
            out["annotations"], out["logprobs"] = [], []
        return out
    if not isinstance(kind, str):
        raise invalid_type(f"{where}.type", "a string", kind)
    if kind in MEDIA_PARTS and role == "user":
        return _media(where, kind, part)
    if kind in MEDIA_PARTS:
        raise unsupported(f"{where}.type", f"'{kind}' content is only accepted in user "
                          "messages.")
    raise invalid_value(f"{where}.type", f"Invalid value: {kind!r}. Supported content part "
                        "types are: input_text, output_text.")


def _media(where: str, kind: str, part: dict) -> dict:
    """An input_image, input_file or input_audio part, its shape checked and kept as sent
    (a later turn replays it: as its placeholder for a text model)."""
    sources = MEDIA_PARTS[kind]
    if not any(part.get(k) is not None for k in sources):
        raise invalid_value(where, f"'{kind}' needs one of: " + ", ".join(sources) + ".")
    for key in sources:
        value = part.get(key)
        if value is not None and not isinstance(value, dict if key == "input_audio" else str):
            raise invalid_type(f"{where}.{key}", "an object" if key == "input_audio"
                               else "a string", value)
    if kind == "input_image":  # travels to the worker: a data: URL or a local file
        #                        (fields/media.py), checked here, read when built
        if part.get("image_url") is None:
            raise unsupported(f"{where}.file_id", "File ids are not supported by this "
                              "server: send the image as image_url, a base64 data: URL.")
        image_part(where, part["image_url"], [], param=f"{where}.image_url")
    if kind == "input_audio":  # travels to the worker: checked here, decoded when built
        audio_part(where, part["input_audio"], [], f"{where}.input_audio")
    kept = {k: part[k] for k in ("type", *sources, "detail", "filename") if k in part}
    if kind == "input_image":  # the spec's InputImageContent always has a detail
        detail = kept.setdefault("detail", "auto")
        if detail not in IMAGE_DETAILS:
            raise invalid_value(f"{where}.detail", f"Invalid value: {detail!r}. Supported "
                                "values are: " + ", ".join(f"'{d}'" for d in IMAGE_DETAILS) + ".")
    return kept


def _tool_output(where: str, parts: list) -> str:
    """A tool's output given as parts (FunctionCallOutputItemParam): its text, an image,
    file or audio part standing as its placeholder (Codex's view_image answers with an
    image): tool messages carry no media to the worker, as on the Messages API."""
    texts = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in MEDIA_PARTS:
            texts.append(placeholder(kind))
        elif isinstance(p, dict) and isinstance(p.get("text"), str):
            texts.append(p["text"])
        else:
            raise invalid_value(f"{where}[{j}]", "expected a text, image, file or audio part.")
    return "".join(texts)


def text_of(item: dict) -> str:
    """A message item's text; a media part stands as its placeholder (fields/media.py)."""
    parts = item.get("content", [])
    return "".join(placeholder(p["type"]) + ("\n" if i < len(parts) - 1 else "")
                   if p.get("type") in MEDIA_PARTS else p.get("text", "")
                   for i, p in enumerate(parts))


def to_chat_messages(items: list[dict], instructions: str | None,
                     images: list | None = None) -> list[dict]:
    """Conversation items → chat messages for the model's template. With `images` (a
    list), a user message's input_image (input_audio) parts become {"type": "image"}
    ({"type": "audio"}) parts, their bytes appended to it in order (the worker's
    Generate.images and .audios, fields/media.py `split`); without, placeholders.

    developer maps to system; every system part, `instructions` first, merges into one
    leading system message (many templates accept only one, at the start). Consecutive
    function_call items become one assistant message with `tool_calls` (joined to the
    assistant text before them); function_call_output becomes a `tool` message; a
    reasoning item rides on the next assistant message as `reasoning_content`.
    """
    system = [instructions] if instructions else []
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        if out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
            return out[-1]
        msg = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for item in items:
        kind = item["type"]
        if kind == "message":
            role = item["role"]
            if role in ("system", "developer"):
                system.append(text_of(item))
            elif role == "assistant":
                msg = {"role": "assistant", "content": text_of(item)}
                if reasoning:
                    msg["reasoning_content"] = "".join(reasoning)
                    reasoning.clear()
                out.append(msg)
            elif images is not None and any(p.get("type") in TRAVELLING
                                            for p in item.get("content", [])):
                out.append({"role": "user", "content": _parts_with_images(item, images)})
            else:
                out.append({"role": "user", "content": text_of(item)})
        elif kind == "function_call":
            msg = out[-1] if out and out[-1]["role"] == "assistant" else assistant()
            msg.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "reasoning":
            text = "".join(p.get("text", "") for p in item.get("content") or [])
            text = text or "".join(p.get("text", "") for p in item.get("summary") or [])
            if text:
                reasoning.append(text)
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(s for s in system if s)})
    return out


def _parts_with_images(item: dict, images: list) -> list[dict]:
    parts = []
    for j, p in enumerate(item.get("content", [])):
        at = f"{item.get('id', 'input')}.content[{j}]"
        if p.get("type") == "input_image":
            parts.append(image_part(at, p["image_url"], images, param=at))
        elif p.get("type") == "input_audio":
            parts.append(audio_part(at, p["input_audio"], images, f"{at}.input_audio"))
        elif p.get("type") in MEDIA_PARTS:
            parts.append({"type": "text", "text": placeholder(p["type"])})
        else:
            parts.append({"type": "text", "text": p.get("text", "")})
    return parts


def output_to_items(output: list[dict]) -> list[dict]:
    """A response's output items, as conversation items for the next turn."""
    return [o for o in output
            if o.get("type") in ("message", "function_call", "reasoning", "compaction")]
