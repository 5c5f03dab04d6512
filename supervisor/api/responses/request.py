"""POST /v1/responses bodies → ResponsesRequest (CreateResponse in OpenAI's spec).

Unknown fields are ignored; wrong types are 400s naming the field. Built-in tool types
(web_search, file_search, ...) cannot run here: they are skipped and named in the
`X-MLXD-Warning` response header instead of failing the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from supervisor.api.params import (invalid_type, invalid_value, missing, opt_bool, opt_int,
                                   opt_list, opt_number, opt_object, opt_str, parse_metadata,
                                   parse_model)
from supervisor.api.responses.items import normalize_input

TEXT_FORMATS = ("text", "json_object", "json_schema")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True, kw_only=True)
class ResponsesRequest:
    model: str
    input_items: list                      # normalised (items.normalize_input)
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    stream: bool = False
    store: bool = True
    background: bool = False
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: list = field(default_factory=list)        # function tools, flat format
    skipped_tools: list = field(default_factory=list)  # built-in tool types not run here
    tool_choice: object = "auto"
    parallel_tool_calls: bool = True
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    reasoning: Optional[dict] = None
    metadata: dict = field(default_factory=dict)
    prompt_cache_key: Optional[str] = None
    user: Optional[str] = None

    @property
    def reasoning_effort(self) -> Optional[str]:
        return (self.reasoning or {}).get("effort")


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
    tools, skipped = _parse_tools(body)
    return ResponsesRequest(
        model=model,
        input_items=items,
        instructions=opt_str(body, "instructions"),
        previous_response_id=opt_str(body, "previous_response_id"),
        stream=bool(opt_bool(body, "stream")),
        store=store is not False,
        background=background,
        max_output_tokens=opt_int(body, "max_output_tokens", minimum=1),
        temperature=opt_number(body, "temperature", 0, 2),
        top_p=opt_number(body, "top_p", 0, 1, exclusive_minimum=True),
        tools=tools,
        skipped_tools=skipped,
        tool_choice=_parse_tool_choice(body, tools),
        parallel_tool_calls=opt_bool(body, "parallel_tool_calls") is not False,
        text_format=_parse_text(body),
        reasoning=_parse_reasoning(body),
        metadata=parse_metadata(body) or {},
        prompt_cache_key=opt_str(body, "prompt_cache_key"),
        user=opt_str(body, "user"),
    )


def _parse_tools(body: dict) -> tuple[list, list]:
    tools, skipped = [], []
    for i, tool in enumerate(opt_list(body, "tools") or []):
        if not isinstance(tool, dict):
            raise invalid_type(f"tools[{i}]", "an object", tool)
        kind = tool.get("type")
        if kind != "function":
            if not isinstance(kind, str):
                raise invalid_type(f"tools[{i}].type", "a string", kind)
            skipped.append(kind)
            continue
        # Accept the nested chat shape too ({"type": "function", "function": {...}}).
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_type(f"tools[{i}].name", "a non-empty string", name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid_type(f"tools[{i}].parameters", "an object", params)
        out = {"type": "function", "name": name, "parameters": params,
               "strict": fn.get("strict") if isinstance(fn.get("strict"), bool) else None}
        if isinstance(fn.get("description"), str):
            out["description"] = fn["description"]
        tools.append(out)
    return tools, skipped


def _parse_tool_choice(body: dict, tools: list):
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid_value("tool_choice", f"Invalid value: '{choice}'. Supported values "
                                "are: 'none', 'auto' and 'required'.")
        if choice == "required" and not tools:
            raise invalid_value("tool_choice", "tool_choice 'required' needs at least one "
                                "function tool.")
        return choice
    if not isinstance(choice, dict):
        raise invalid_type("tool_choice", "a string or an object", choice)
    if choice.get("type") != "function":
        raise invalid_value("tool_choice.type", "Only function tool choices are supported.")
    name = choice.get("name") or (choice.get("function") or {}).get("name")
    if name not in {t["name"] for t in tools}:
        raise invalid_value("tool_choice.name", f"No function tool named {name!r} was given.")
    return {"type": "function", "name": name}


def _parse_text(body: dict) -> dict:
    text = opt_object(body, "text")
    fmt = (text or {}).get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise invalid_type("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind not in TEXT_FORMATS:
        raise invalid_value("text.format.type", f"Invalid value: {kind!r}. Supported values "
                            "are: 'text', 'json_object' and 'json_schema'.")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid_type("text.format.schema", "an object", fmt.get("schema"))
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise invalid_type("text.format.name", "a non-empty string", fmt.get("name"))
    return fmt


def _parse_reasoning(body: dict) -> Optional[dict]:
    reasoning = opt_object(body, "reasoning")
    if reasoning is None:
        return None
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid_value("reasoning.effort", f"Invalid value: {effort!r}. Supported values "
                            "are: " + ", ".join(f"'{e}'" for e in EFFORTS) + ".")
    return {"effort": effort, "summary": reasoning.get("summary")}
