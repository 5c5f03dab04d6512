"""A vision model's processed images, remembered by the images' bytes, so that the next
turn about the same image neither decodes it nor runs the image processor again.

A conversation about an image sends the image with every turn. Its prompt's token ids
depend on the image only through the processor's expansion of the image placeholder
(how many image tokens, from the grid or crops the image processor cut it into), and
its state past the image is in the KV cache (worker/vision/batch.py: no vision tower
when the cache covers the image). What is left per turn is the image processor itself
(decoding, resizing, normalizing, patching: the costly part of `prepare` for an image)
— its output is the same for the same bytes.

So the processor's `image_processor` is replaced by `Remembered`, which hands its
calls through and keeps each output under the digests of the request's images (all of
them: the processor cuts a request's images in one call). A request whose images are
all known gives the processor 1×1 stand-ins and the output kept for them: the
processor's own code expands the placeholders from that output and tokenizes, so the
token ids are exactly those it gives the first time, and the pixel arrays are there
for the vision tower should the KV cache no longer hold the image. A processor that
makes its image arrays some other way than by calling its image processor (the kept
output was not asked for) gets the real images again, and nothing more is kept.

Held in bytes up to a budget, least recently used out first. The preparation threads
call it (worker/loop/preparer.py: two at once), and the warm-up before they start: what
a call hands its processor, whether it was asked for it and what a real run made are
the calling thread's own, and the kept outputs change under a lock.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any, Callable

from PIL import Image

BUDGET = 128 << 20   # bytes of processed images kept


def _nbytes(output) -> int:
    """The bytes of an image processor's output: its arrays, in a mapping or a tuple
    (Gemma 4's: its arrays and the images' token counts) at any depth."""
    if hasattr(output, "values") and callable(output.values):
        return sum(_nbytes(v) for v in output.values())
    if isinstance(output, (list, tuple)):
        return sum(_nbytes(v) for v in output)
    return getattr(output, "nbytes", 0)


class Remembered:
    """A processor's image processor whose outputs are kept by the images' digests (see
    the module's doc); every other attribute is the image processor's own."""

    def __init__(self, inner, budget: int = BUDGET):
        self.inner = inner
        self.budget = budget
        self.nbytes = 0
        self.hits = 0
        self._kept: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()  # LRU first
        self._lock = threading.Lock()  # (over `_kept`, `nbytes`, `hits`)
        # Per calling thread: `given`, the output its next call answers with; `asked`,
        # whether the processor asked for it; `made`, the output its last real call made.
        self._call = threading.local()

    def __getattr__(self, name):
        if name in ("inner", "_call"):  # (not set yet: copying, pickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        call = self._call
        given = getattr(call, "given", None)
        if given is not None:
            call.asked = True
            return copy.copy(given)  # (processors pop from it: Gemma 3's num_crops)
        output = self.inner(*args, **kwargs)
        call.made = copy.copy(output)
        return output

    def process(self, digests: tuple, decode: Callable[[], list], call: Callable[[list], Any]):
        """`call(images)` (the processor's run over a request's images) for the images of
        these `digests`: with stand-ins and the kept output when they are known, with
        `decode()`'s images otherwise (their output then kept)."""
        state = self._call
        with self._lock:
            entry = self._kept.get(digests)
            if entry is not None:
                self._kept.move_to_end(digests)
        if entry is not None:
            state.given, state.asked = entry[0], False
            try:
                inputs = call([Image.new("RGB", (1, 1)) for _ in digests])
            finally:
                state.given = None
            with self._lock:
                if state.asked:
                    self.hits += 1
                    return inputs
                self.budget = 0  # this processor makes its arrays otherwise: keep nothing
                self._drop(digests)
        state.made = None
        inputs = call(decode())
        if state.made is not None:
            with self._lock:
                self._keep(digests, state.made)
            state.made = None
        return inputs

    def _keep(self, digests: tuple, output) -> None:
        """(under the lock)"""
        size = _nbytes(output)
        if size > self.budget:
            return
        self._drop(digests)
        self._kept[digests] = (output, size)
        self.nbytes += size
        while self.nbytes > self.budget:
            self._drop(next(iter(self._kept)))

    def _drop(self, digests: tuple) -> None:
        entry = self._kept.pop(digests, None)
        if entry is not None:
            self.nbytes -= entry[1]

    def clear(self) -> None:
        with self._lock:
            for digests in list(self._kept):
                self._drop(digests)
