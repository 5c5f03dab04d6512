"""Protocol codec cost: µs to encode and to decode one message, in process (no sockets).

    python -m bench.codec [--number N] [--repeat R]

Two messages: a one-token Delta (one per decode step, unless steps share one: the hot
path, paid on both sides of the socket for every token) and a Generate with a two-message
chat (one per request). Each figure is the best of R rounds of N calls, the round least
disturbed by whatever else the machine runs; sizes are the frames' bytes.

Before, for comparison: protocol version 1 (frozen dataclasses and a hand-written codec over
msgpack-python) took 3.6 µs to encode and 13.1 µs to decode the same one-token Delta
(153 bytes) on the machine where the protocol moved to msgspec Structs (version 2).
"""

from __future__ import annotations

import argparse
import timeit

from bench.report import print_table
from protocol import (Delta, Generate, OutputSpec, SamplingParams, decode_down, decode_up,
                      encode, pack_ids)

# Version 1's figures for the one-token Delta (see the docstring).
BEFORE_DELTA_US = {"encode": 3.6, "decode": 13.1}


def messages() -> list[tuple[str, object, object]]:
    """(name, message, the decoder of its direction). A real rid: 24 hex digits and the
    attempt (supervisor/workers/handle.py)."""
    rid = "0123456789abcdef01234567-1"
    delta = Delta(epoch=1, rid=rid, text=" world", token_ids=pack_ids([1917]))
    chat = Generate(
        rid=rid, messages=[{"role": "system", "content": "You are a helpful assistant."},
                           {"role": "user", "content": "Write a haiku about the sea."}],
        sampling=SamplingParams(max_tokens=256, temperature=0.7, top_p=0.95),
        output=OutputSpec(stop=("\n\n",)))
    return [("Delta, one token", delta, decode_up), ("Generate, 2-message chat", chat,
                                                     decode_down)]


def best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--number", type=int, default=100_000, help="calls per round")
    p.add_argument("--repeat", type=int, default=5, help="rounds (the best counts)")
    args = p.parse_args()

    rows = []
    for name, msg, decode in messages():
        raw = encode(msg)
        assert decode(raw) == msg
        for op, fn in (("encode", lambda: encode(msg)), ("decode", lambda: decode(raw))):
            before = (f"version 1: {BEFORE_DELTA_US[op]:.1f} µs"
                      if name.startswith("Delta") else "")
            rows.append((f"{name} ({len(raw)} B): {op}",
                         f"{best_us(fn, args.number, args.repeat):.2f} µs", before))
    print_table(f"python -m bench.codec --number {args.number} --repeat {args.repeat}", rows)


if __name__ == "__main__":
    main()
