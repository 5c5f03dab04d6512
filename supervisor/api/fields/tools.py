"""Tools, tool_choice and response_format: validated once, for every API surface.

Chat completions and the Responses API spell these differently; both are accepted and
normalized to one form, then to protocol.OutputSpec fields (`output`, below):

    tools        chat:      {"type": "function", "function": {"name", "description", "parameters", "strict"}}
                 Responses: {"type": "function", "name", "description", "parameters", "strict"}
                 → always the chat (nested) form: it is what chat templates render.
    tool_choice  "none" | "auto" | "required"
                 | {"type": "function", "function": {"name"}}   (chat)
                 | {"type": "function", "name"}                 (Responses)
                 | {"type": "allowed_tools", "mode": "auto"|"required", "tools": [...]}
                   (both; chat nests it under "allowed_tools")
                 → ToolChoice(mode, allowed names or None)
    response_format / text.format
                 {"type": "text"} | {"type": "json_object"}
                 | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   (chat)
                 | {"type": "json_schema", "name", "schema", "strict"}                    (Responses)
                 → ResponseFormat(kind, schema, name, strict)

The worker compiles the grammar; a schema llguidance rejects comes back as a 400 too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from protocol.messages import OutputSpec
from supervisor.api.fields.limits import MAX_TOOLS, check_length
from supervisor.api.fields.params import invalid_type, invalid_value, missing, opt_bool, opt_str

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MODES = ("none", "auto", "required")
FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"                      # none | auto | required
    allowed: Optional[tuple] = None         # names a call may use; None: all tools


@dataclass(frozen=True)
class ResponseFormat:
    kind: str = "text"                      # text | json_object | json_schema
    schema: Optional[dict] = None
    name: Optional[str] = None
    strict: Optional[bool] = None


def only_tool(tools: tuple, choice: ToolChoice) -> str:
    """The one function a call could name (a call cut off before its name was written),
    else "": the tools the choice allows, else all of them, when that is one."""
    names = choice.allowed or tuple(t["function"]["name"] for t in tools)
    return names[0] if len(names) == 1 else ""


def normalize_tools(value, param: str = "tools") -> tuple:
    """A tools array (chat's nested or the Responses API's flat form) → nested dicts."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid_type(param, "an array", value)
    check_length(param, value, MAX_TOOLS)
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise invalid_type(where, "an object", tool)
        kind = tool.get("type")
        if kind is None:
            raise missing(f"{where}.type")
        if kind != "function":
            raise invalid_value(f"{where}.type", f"'{kind}'. This server supports tools of "
                                "type 'function'.", "unsupported_value")
        fn = tool.get("function")
        if fn is None:  # the Responses API's flat form
            fn, fwhere = tool, where
        elif not isinstance(fn, dict):
            raise invalid_type(f"{where}.function", "an object", fn)
        else:
            fwhere = f"{where}.function"
        name = fn.get("name")
        if name is None:
            raise missing(f"{fwhere}.name")
        if not isinstance(name, str):
            raise invalid_type(f"{fwhere}.name", "a string", name)
        if not _NAME.match(name):
            raise invalid_value(f"{fwhere}.name", f"'{name}'. Function names are 1 to 64 "
                                "letters, digits, underscores or dashes.")
        if name in names:
            raise invalid_value(param, f"the function name '{name}' is given twice.")
        names.add(name)
        norm = {"name": name}
        desc = opt_str(fn, "description", f"{fwhere}.description")
        if desc is not None:
            norm["description"] = desc
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise invalid_type(f"{fwhere}.parameters", "an object", params)
            norm["parameters"] = params
        strict = opt_bool(fn, "strict", f"{fwhere}.strict")
        if strict is not None:
            norm["strict"] = strict
        out.append({"type": "function", "function": norm})
    return tuple(out)


def tool_names(tools: tuple) -> set:
    return {t["function"]["name"] for t in tools}


def parse_tool_choice(value, tools: tuple, param: str = "tool_choice") -> ToolChoice:
    """Validate tool_choice against the normalized tools. Without tools only "none" and
    "auto" mean anything (both: answer in text)."""
    if value is None:
        return ToolChoice("auto")
    names = tool_names(tools)
    if isinstance(value, str):
        if value not in MODES:
            raise invalid_value(param, f"'{value}'. Supported values are: 'none', 'auto', "
                                "'required', or an object naming a function.")
        if value == "required" and not tools:
            raise invalid_value(param, "'required' needs at least one tool in 'tools'.")
        return ToolChoice(value if tools else "auto")  # no tools: nothing to call either way
    if not isinstance(value, dict):
        raise invalid_type(param, "a string or an object", value)
    kind = value.get("type")
    if kind == "function":
        fn = value.get("function", value)  # chat nests the name, Responses does not
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise missing(f"{param}.function.name" if "function" in value else f"{param}.name")
        if name not in names:
            raise invalid_value(param, f"the function '{name}' is not one of 'tools'.")
        return ToolChoice("required", (name,))
    if kind == "allowed_tools":
        spec = value.get("allowed_tools", value)  # chat nests it, Responses does not
        where = f"{param}.allowed_tools" if "allowed_tools" in value else param
        mode = spec.get("mode") if isinstance(spec, dict) else None
        if mode not in ("auto", "required"):
            raise invalid_value(f"{where}.mode", "expected 'auto' or 'required'.")
        listed = spec.get("tools")
        if not isinstance(listed, list) or not listed:
            raise invalid_value(f"{where}.tools", "expected a non-empty array of tools.")
        allowed = []
        for i, t in enumerate(listed):
            fn = t.get("function", t) if isinstance(t, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if name not in names:
                raise invalid_value(f"{where}.tools[{i}]", "expected a function of 'tools'.")
            allowed.append(name)
        return ToolChoice(mode, tuple(allowed))
    if kind is None:
        raise missing(f"{param}.type")
    raise invalid_value(f"{param}.type", f"'{kind}'. Supported values are: 'function', "
                        "'allowed_tools'.")


def parse_response_format(value, param: str = "response_format") -> ResponseFormat:
    """Validate a response format (chat's, or the Responses API's text.format)."""
    if value is None:
        return ResponseFormat()
    if not isinstance(value, dict):
        raise invalid_type(param, "an object", value)
    kind = value.get("type")
    if kind is None:
        raise missing(f"{param}.type")
    if kind not in FORMATS:
        raise invalid_value(f"{param}.type", f"'{kind}'. Supported values are: 'text', "
                            "'json_object', 'json_schema'.")
    if kind != "json_schema":
        return ResponseFormat(kind)
    spec, where = value, param
    if "json_schema" in value:  # chat nests it
        spec, where = value["json_schema"], f"{param}.json_schema"
        if not isinstance(spec, dict):
            raise invalid_type(where, "an object", spec)
    name = opt_str(spec, "name", f"{where}.name")
    if name is None:
        raise missing(f"{where}.name")
    if not _NAME.match(name):
        raise invalid_value(f"{where}.name", f"'{name}'. Names are 1 to 64 letters, digits, "
                            "underscores or dashes.")
    schema = spec.get("schema")
    if schema is None:
        schema = {}  # OpenAI: no schema means any JSON value; an object is what people mean
    if not isinstance(schema, dict):
        raise invalid_type(f"{where}.schema", "an object", schema)
    return ResponseFormat("json_schema", schema, name, opt_bool(spec, "strict", f"{where}.strict"))


def output(tools: tuple, choice: ToolChoice, fmt: ResponseFormat, *,
           parallel_tool_calls: Optional[bool] = None, stop: tuple = (),
           logprobs: bool = False, top_logprobs: int = 0,
           reasoning_effort: Optional[str] = None, echo: bool = False) -> OutputSpec:
    """What the output must look like, from the validated tools, tool_choice and
    response format (above) and the surface's other options."""
    return OutputSpec(
        stop=tuple(stop),
        logprobs=logprobs,
        top_logprobs=top_logprobs if logprobs else 0,
        response_format=None if fmt.kind == "text" else fmt.kind,
        json_schema=fmt.schema if fmt.kind == "json_schema" else None,
        tools=[dict(t) for t in tools] or None,
        tool_choice=choice.mode if tools else None,
        allowed_tools=tuple(choice.allowed) if choice.allowed is not None else None,
        parallel_tool_calls=parallel_tool_calls is not False,
        reasoning_effort=reasoning_effort,
        echo=echo,
    )
