"""Anthropic's usage counts prompt tokens the prefix cache supplied as
`cache_read_input_tokens` and leaves them out of `input_tokens` (their sum is the prompt),
in the message, in the stream's `message_start` and in its `message_delta`
(supervisor/api/messages/). The fake worker here reports part of each prompt as cached."""

from __future__ import annotations

import msgspec

from protocol import Done, Started
from tests.supervisor.fakes import FakeBehaviour, FakeLink, FakeWorld
from tests.supervisor.test_app import client_for
from tests.supervisor.test_messages_routes import BODY, HEADERS, events_of

CACHED = 8
PROMPT = "hello there"  # the fake counts a character a token: 11, of which 8 cached
USAGE = {"input_tokens": len(PROMPT) - CACHED, "cache_creation_input_tokens": 0,
         "cache_read_input_tokens": CACHED}


class CachingLink(FakeLink):
    """The fake worker, reporting the first CACHED prompt tokens as the cache's."""

    def _emit(self, msg) -> None:
        if isinstance(msg, (Started, Done)) and msg.prompt_tokens >= CACHED:
            msg = msgspec.structs.replace(msg, cached_tokens=CACHED)
        super()._emit(msg)


def caching_factory(model: str):
    world = FakeWorld(FakeBehaviour(tokens=3))

    def make(epoch: int) -> CachingLink:
        link = CachingLink(epoch, world.default, world)
        world.links.append(link)
        return link
    return make


BODY_CACHED = {**BODY, "messages": [{"role": "user", "content": PROMPT}]}


async def test_the_message_and_every_stream_event_leave_cache_reads_out_of_input_tokens():
    client = await client_for(None, factory_for=caching_factory)
    try:
        r = await client.post("/v1/messages", json=BODY_CACHED, headers=HEADERS)
        body = await r.json()
        assert r.status == 200, body
        assert body["usage"] == {**USAGE, "output_tokens": 3}
        r = await client.post("/v1/messages", json={**BODY_CACHED, "stream": True},
                              headers=HEADERS)
        events = dict(events_of(await r.text()))
        assert events["message_start"]["message"]["usage"] == {**USAGE, "output_tokens": 0}
        assert events["message_delta"]["usage"] == {**USAGE, "output_tokens": 3}
    finally:
        await client.close()
