"""A request's choices: OpenAI's `n`, and a legacy completion's batch of prompts, each
choice a Generate of its own, merged back into one response (lifecycle.run).

Choices are numbered prompt by prompt, `n` each (choice p * n + j is prompt p's j-th), as
OpenAI numbers them. Each runs as a sequence of the worker's continuous batch, side by
side with the others and with other clients' requests, and is admitted, queued, timed out
and cancelled like any request; a request whose choice fails fails whole (the others are
cancelled), as one Generate's failure fails its request.

- Seeds: with a `seed`, choice j of a prompt samples with seed + j (in int64), so the
  choices differ and the same request gives the same choices again; without one each is
  random. At temperature 0 every choice is the same text, as OpenAI's are.
- One prefill: a prompt's first choice tells the worker that `n - 1` requests with its
  prompt follow (PromptCache.repeats); it keeps the prompt's state when its prefill ends
  and the others start from it (worker/loop/batch.py `same`), where prefilled side by
  side a long prompt cost n times the compute and time to the first token.
- KV snapshots: a prompt_cache_key's snapshot is kept by the prompt's first choice only
  (n sequences keeping one name would replace each other's); the others still share the
  prompt through the prefix cache.
- Usage: a prompt counts once however many choices it has (OpenAI's `prompt_tokens` for
  `n`), its cached tokens as its first choice found them; completion, reasoning and
  prediction tokens add up over all choices.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from msgspec.structs import replace

from protocol import Done, Generate

INT64 = 1 << 64
END = object()   # `events`: a choice has ended (its Generation's `done` is set)


def fan_out(prompts: list[Generate], n: int) -> list[Generate]:
    """Each prompt's `n` choices, in OpenAI's order."""
    if n == 1:
        return list(prompts)
    return [_choice(message, j, n) for message in prompts for j in range(n)]


def _choice(message: Generate, j: int, n: int) -> Generate:
    if j == 0:  # (the worker prefills the prompt once: the others start from its state)
        return replace(message, cache=replace(message.cache, repeats=n - 1))
    seed = message.sampling.seed
    if seed is not None:
        seed = (seed + j + INT64 // 2) % INT64 - INT64 // 2  # (wraps within int64)
    return replace(message, sampling=replace(message.sampling, seed=seed),
                   cache=replace(message.cache, keep_as=None))


def usage_parts(dones: list[Done], n: int) -> dict:
    """lifecycle.usage's arguments for the choices' Dones (by index, `n` a prompt)."""
    firsts = dones[::n]
    return {"prompt_tokens": sum(d.prompt_tokens for d in firsts),
            "cached_tokens": sum(d.cached_tokens for d in firsts),
            "completion_tokens": sum(d.completion_tokens for d in dones),
            "reasoning_tokens": sum(d.reasoning_tokens for d in dones),
            "accepted_prediction": sum(d.accepted_prediction_tokens for d in dones),
            "rejected_prediction": sum(d.rejected_prediction_tokens for d in dones)}


async def collect(gens: list) -> list:
    """Each choice's whole Output, by index. The first failure raises here, and the other
    choices' reads are cancelled with it (gather alone would leave them waiting)."""
    tasks = [asyncio.ensure_future(gen.collect()) for gen in gens]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def events(gens: list, idle: float | None = None) -> AsyncIterator:
    """The choices' output as it comes: (index, Part), (index, END) when choice `index`
    has ended, and None after `idle` quiet seconds (for SSE pings). A choice's failure
    raises here; the caller closes every Generation."""
    if len(gens) == 1:  # (no tasks or queue on a lone choice's per-token path)
        async for part in gens[0].parts(idle=idle):
            yield None if part is None else (0, part)
        yield 0, END
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen) -> None:
        try:
            async for part in gen.parts():
                queue.put_nowait((index, part))
            queue.put_nowait((index, END))
        except Exception as e:  # (a cancellation is ours: it ends the pump, unreported)
            queue.put_nowait((index, e))

    pumps = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            try:
                index, item = await asyncio.wait_for(queue.get(), idle)
            except asyncio.TimeoutError:
                yield None
                continue
            if isinstance(item, Exception):
                raise item
            left -= item is END
            yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
