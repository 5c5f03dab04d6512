"""The 17 cases of the Open Responses compliance suite, by upstream id (compliance.py says
why they are re-written here). Each takes a Suite and returns the failures, [] on a pass.
"""

from __future__ import annotations

import time

from tests.openresponses.compliance import (
    HEART_PNG, WEATHER_TOOL, Suite, http_case, message, response_errors, schema_problems,
    turn_errors)


def basic_response(s: Suite) -> list[str]:
    return http_case(s, [message("user", "Say hello in exactly 3 words.")])


def assistant_phase(s: Suite) -> list[str]:
    return http_case(s, [
        message("assistant", "I should answer with the saved number.", phase="commentary"),
        message("assistant", "The number is four.", phase="final_answer"),
        message("user", "Repeat only the number.")])


def response_output_phase_schema(s: Suite) -> list[str]:
    """Upstream validates a fixed Response of its own (two assistant messages with
    phases) against its schema, sending nothing: this checks the same object against the
    schema these cases use, so a schema that refuses `phase` is caught here."""
    message = {"type": "message", "status": "completed", "role": "assistant"}
    fixture = {
        "id": "resp_phase_schema", "object": "response", "created_at": 1764967971,
        "completed_at": 1764967972, "status": "completed", "incomplete_details": None,
        "model": s.model, "previous_response_id": None, "instructions": None,
        "output": [
            {**message, "id": "msg_phase_commentary", "phase": "commentary", "content": [
                {"type": "output_text", "text": "I am checking the answer.", "annotations": []}]},
            {**message, "id": "msg_phase_final", "phase": "final_answer", "content": [
                {"type": "output_text", "text": "The answer is four.", "annotations": []}]}],
        "error": None, "tools": [], "tool_choice": "auto", "truncation": "disabled",
        "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "top_p": 1,
        "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0, "temperature": 1,
        "reasoning": {"effort": None, "summary": None},
        "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "max_output_tokens": None, "max_tool_calls": None, "store": True, "background": False,
        "service_tier": "default", "metadata": {}, "safety_identifier": None,
        "prompt_cache_key": None}
    errors = response_errors(fixture)
    for phase in ("commentary", "final_answer"):
        if not any(o.get("phase") == phase for o in fixture["output"]):
            errors.append(f"no assistant message with phase {phase!r}")
    return errors


def streaming_response(s: Suite) -> list[str]:
    return turn_errors(s.stream({"model": s.model,
                                 "input": [message("user", "Count from 1 to 5.")]}))


def system_prompt(s: Suite) -> list[str]:
    return http_case(s, [message("system", "You are a pirate. Always respond in pirate speak."),
                         message("user", "Say hello.")])


def tool_calling(s: Suite) -> list[str]:
    return http_case(s, [message("user", "What's the weather like in San Francisco?")],
                     tools=[WEATHER_TOOL], expect_type="function_call")


def image_input(s: Suite) -> list[str]:
    return http_case(s, [message("user", [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": HEART_PNG}])])


def multi_turn(s: Suite) -> list[str]:
    return http_case(s, [
        message("user", "My name is Alice."),
        message("assistant", "Hello Alice! Nice to meet you. How can I help you today?"),
        message("user", "What is my name?")])


def compact_response(s: Suite) -> list[str]:
    r = s.post("/responses/compact", {
        "model": s.model, "prompt_cache_key": "openresponses-compact-test", "input": [
            message("user", "We agreed to launch on Tuesday and notify support first."),
            message("assistant",
                 "Understood. The launch is Tuesday, with support notified beforehand.")]})
    if r.status_code != 200:
        return [f"HTTP {r.status_code}: {r.text[:500]}"]
    body = r.json()
    errors = schema_problems(body, "CompactResource")
    if body.get("object") != "response.compaction":
        errors.append(f"expected object 'response.compaction', got {body.get('object')!r}")
    if not any(o.get("type") == "compaction" for o in body.get("output") or ()):
        errors.append("no output item of type 'compaction'")
    return errors


def compact_missing_model(s: Suite) -> list[str]:
    r = s.post("/responses/compact", {"input": [message("user", "Compact this conversation.")]})
    return [] if r.status_code in (400, 422) else [f"expected 400 or 422, got {r.status_code}"]


def websocket_response(s: Suite) -> list[str]:
    [turn] = s.socket(s.create([message("user", "Count from 1 to 3.")]))
    return turn_errors(turn)


def websocket_sequential_responses(s: Suite) -> list[str]:
    turns = s.socket(s.create("Reply with exactly: first", store=False),
                     s.create("Reply with exactly: second", store=False))
    return [e for i, t in enumerate(turns) for e in turn_errors(t, f"turn {i + 1}: ")]


def _continue(s: Suite, text_or_items):
    """A step continuing the first turn's response; None (ends early) if it has no id."""
    def step(turns):
        first = turns[0].final or {}
        return first.get("id") and s.create(text_or_items, store=False,
                                            previous_response_id=first["id"]) or None
    return step


def _first_turn_errors(turns) -> list[str]:
    first = turns[0]
    errors = list(first.errors) + response_errors(first.final, output=False, completed=False)
    if not (first.final or {}).get("id"):
        errors.append("the first turn returned no response id")
    return errors


def websocket_continuation(s: Suite) -> list[str]:
    turns = s.socket(s.create("Remember the code word: cobalt. Reply with OK.", store=False),
                     _continue(s, "What is the code word? Reply with only the code word."))
    errors = _first_turn_errors(turns)
    return errors or (turn_errors(turns[1]) if len(turns) > 1 else ["no second turn"])


def websocket_reconnect_store_false_recovery(s: Suite) -> list[str]:
    first = s.socket(s.create("Remember the code word: copper. Reply with OK.", store=False))
    errors = _first_turn_errors(first)
    if errors:
        return errors
    miss, recovery = s.socket(
        s.create("Try to continue after reconnect. Reply with exactly: reconnected",
                 store=False, previous_response_id=first[0].final["id"]),
        s.create([message("user", "The previous store:false chain could not continue after "
                       "reconnect. Start a new response and reply with exactly: recovered")],
                 store=False))
    errors = list(miss.errors)
    if miss.error_code != "previous_response_not_found":
        errors.append(f"after reconnecting, expected previous_response_not_found, got "
                      f"{miss.error_code!r}")
    return errors + turn_errors(recovery, "recovery: ")


def websocket_previous_response_not_found(s: Suite) -> list[str]:
    [turn] = s.socket(s.create("This should fail because the previous response is missing.",
                               store=False,
                               previous_response_id=f"resp_openresponses_missing_{time.time_ns()}"))
    errors = list(turn.errors)
    if turn.error_code != "previous_response_not_found":
        errors.insert(0, f"expected previous_response_not_found, got {turn.error_code!r}")
    return errors


def websocket_failed_continuation_evicts_cache(s: Suite) -> list[str]:
    turns = s.socket(
        s.create("Remember the code word: ember. Reply with OK.", store=False),
        _continue(s, [{"type": "function_call_output", "call_id": "call_openresponses_missing",
                       "output": "No matching tool call exists in the previous response."}]),
        _continue(s, "Try to continue after the failed turn. Reply with exactly: stale"))
    errors = _first_turn_errors(turns)
    if errors:
        return errors
    if len(turns) < 3:
        return ["the connection ended before the retry"]
    failed, retry = turns[1], turns[2]
    if not failed.failed:
        errors += failed.errors + [f"expected the continuation to fail, got status "
                                   f"{(failed.final or {}).get('status')!r}"]
    errors += retry.errors
    if retry.error_code != "previous_response_not_found":
        errors.append(f"after the failed continuation, expected previous_response_not_found,"
                      f" got {retry.error_code!r}")
    return errors


def websocket_compact_new_chain(s: Suite) -> list[str]:
    r = s.post("/responses/compact", {"model": s.model, "input": [
        message("user", [{"type": "input_text",
                          "text": "Remember the compaction code word: slate."}]),
        message("assistant", [{"type": "output_text", "text": "OK."}]),
        message("user", [{"type": "input_text",
                       "text": "Compress this conversation for later continuation."}])]})
    if r.status_code != 200:
        return [f"HTTP {r.status_code} from /responses/compact: {r.text[:500]}"]
    output = r.json().get("output")
    if not isinstance(output, list):
        return ["the compacted response has no output list"]
    [turn] = s.socket(s.create(
        [*output, message("user", "Continue from here. Reply with exactly: compacted")],
        store=False, tools=[]))
    turn.errors = [e for e in turn.errors if not e.startswith("request: ")]  # as upstream
    return turn_errors(turn)


CASES = {name.replace("_", "-"): fn for name, fn in [
    ("basic_response", basic_response), ("assistant_phase", assistant_phase),
    ("response_output_phase_schema", response_output_phase_schema),
    ("streaming_response", streaming_response), ("websocket_response", websocket_response),
    ("websocket_sequential_responses", websocket_sequential_responses),
    ("websocket_continuation", websocket_continuation),
    ("websocket_reconnect_store_false_recovery", websocket_reconnect_store_false_recovery),
    ("websocket_previous_response_not_found", websocket_previous_response_not_found),
    ("websocket_failed_continuation_evicts_cache", websocket_failed_continuation_evicts_cache),
    ("websocket_compact_new_chain", websocket_compact_new_chain),
    ("system_prompt", system_prompt), ("tool_calling", tool_calling),
    ("image_input", image_input), ("multi_turn", multi_turn),
    ("compact_response", compact_response), ("compact_missing_model", compact_missing_model)]}
