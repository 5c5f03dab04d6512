"""supervisor/api/responses/truncation.py's pure parts: where a cut conversation may start
(whole turns: a user message, never a tool call's output without its call), what the
worker takes, and which inputs fit uncounted."""

from __future__ import annotations

from protocol.messages import Generate
from supervisor.api.responses.truncation import TEMPLATE_MARGIN, room, surely_fits, turn_starts


def msg(role, text="x"):
    return {"type": "message", "role": role, "content": text}


def test_turns_start_at_user_messages_after_the_leading_system_ones():
    items = [msg("system"), msg("developer"), msg("user"), msg("assistant"),
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c", "output": "ok"},
             msg("user"), msg("assistant"), msg("user")]
    assert turn_starts(items) == (2, [6, 8])
    assert turn_starts([msg("user")]) == (0, [])  # (one turn: nothing to drop)
    assert turn_starts([msg("user"), msg("assistant"), msg("user")]) == (0, [2])


def test_the_room_the_worker_leaves_a_prompt():
    assert room(512, 8) == 504
    assert room(512, None) == 511  # (no completion asked for: one token of room)


def test_a_short_text_input_fits_uncounted_and_media_is_always_counted():
    short = Generate(rid="", messages=[msg("user", "hello")])
    assert surely_fits(short, TEMPLATE_MARGIN + 400)  # (the message and its output spec)
    assert not surely_fits(short, TEMPLATE_MARGIN)
    assert not surely_fits(Generate(rid="", messages=[msg("user", "x" * 5000)]),
                           TEMPLATE_MARGIN + 4000)
    image = Generate(rid="", messages=[msg("user", "hello")], images=(b"png",))
    assert not surely_fits(image, 1 << 20)
