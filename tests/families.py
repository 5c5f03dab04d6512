"""The chat templates of real tool-calling families, for tests only: tiny models built with
them (the `family_model` fixture) make mlx-lm infer the same tool parser and thinking
markers as for the real models, so tool calls and reasoning are tested in each family's
own format. They live here, not in worker/demos/text.py, because nothing at run time or in the
benchmarks uses them; the shared ChatML skeleton (`tool_template`) and the Qwen family,
which the constrained-decoding benchmark needs too, stay in worker/demos/text.py.
"""

from __future__ import annotations

from worker.demos.text import ARGS_JSON, CHATML, QWEN, ChatTemplate, tool_template

FAMILIES: dict[str, ChatTemplate] = {t.name: t for t in [
    # Plain ChatML: no tool-call format at all.
    CHATML,
    # Hermes / Qwen2.5 / Qwen3: <tool_call>{json}</tool_call>, <think>…</think>.
    QWEN,
    # Qwen3-Coder: <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n...
    tool_template(
        "qwen3_coder",
        # (HF renders with trim_blocks: a newline right after a tag is dropped, so
        # newlines next to tags are written as expressions.)
        "\n<tool_call>\n<function={{ tool_call.name }}>"
        "{% for k, v in tool_call.arguments.items() %}{{ '\\n' }}<parameter={{ k }}>\n"
        "{{ v if v is string else v | tojson }}\n</parameter>{% endfor %}{{ '\\n' }}"
        "</function>\n</tool_call>",
        ("<tool_call>", "</tool_call>")),
    # Llama 3.1+: a bare {"name": ..., "parameters": {...}} answer is a call.
    tool_template(
        "llama3",
        "{\"name\": \"{{ tool_call.name }}\", \"parameters\": " + ARGS_JSON + "}",
        instructions="Respond in the format {\"name\": function name, \"parameters\": "
        "dictionary of argument name and its value}."),
    # Mistral (v11+ templates): [TOOL_CALLS]name[ARGS]{json}
    tool_template(
        "mistral", "[TOOL_CALLS]{{ tool_call.name }}[ARGS]" + ARGS_JSON,
        ("[TOOL_CALLS]", "[ARGS]")),
    # FunctionGemma: <start_function_call>call:name{k:<escape>text<escape>,n:1}<end_function_call>
    tool_template(
        "gemma",
        # (braces as expressions: a literal "{" before "{%" would read as "{{")
        "<start_function_call>call:{{ tool_call.name }}{{ '{' }}"
        "{% for k, v in tool_call.arguments.items() %}{{ k }}:"
        "{% if v is string %}<escape>{{ v }}<escape>{% else %}{{ v | tojson }}{% endif %}"
        "{{ ',' if not loop.last }}{% endfor %}{{ '}' }}<end_function_call>",
        ("<start_function_call>", "<end_function_call>", "<escape>")),
    # LFM2-style pythonic: <|tool_call_start|>[name(k=v, ...)]<|tool_call_end|>
    tool_template(
        "pythonic",
        "<|tool_call_start|>[{{ tool_call.name }}("
        "{% for k, v in tool_call.arguments.items() %}{{ k }}={{ v | tojson }}"
        "{{ ', ' if not loop.last }}{% endfor %})]<|tool_call_end|>",
        ("<|tool_call_start|>", "<|tool_call_end|>")),
]}
