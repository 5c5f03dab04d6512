"""worker/vision/processed.py on its own, with a stand-in image processor: what is kept,
within its budget, and a processor that never asks for the kept output gets the real
images. (Its use on the real processors: test_worker_vision_batch's next-turn test.)"""

from __future__ import annotations

import numpy as np

from worker.vision.processed import Remembered


class Cutter:
    """An image processor: one array of 100 bytes per image."""
    size = {"longest_edge": 64}

    def __init__(self):
        self.calls = 0

    def __call__(self, images):
        self.calls += 1
        return {"pixel_values": np.full((len(images), 25), self.calls, np.float32),
                "num_crops": [0] * len(images)}


def processor_call(remembered, pops: bool = True):
    """A processor's run: its image processor's output (with a key popped, as Gemma 3's
    does) and the images it was given."""
    def call(images):
        out = remembered(images)
        if pops:
            out.pop("num_crops")
        return out, images
    return call


def test_known_images_get_the_kept_output_and_their_attributes_pass_through():
    cutter = Cutter()
    r = Remembered(cutter, budget=250)
    decoded = []
    decode = lambda: decoded.append(1) or ["a real image"]  # noqa: E731
    first, _ = r.process((b"a",), decode, processor_call(r))
    again, images = r.process((b"a",), decode, processor_call(r))
    assert cutter.calls == 1 and len(decoded) == 1 and r.hits == 1
    assert (again["pixel_values"] == first["pixel_values"]).all()
    assert images[0].size == (1, 1)  # a stand-in, not the image
    assert r.size == {"longest_edge": 64}
    # Within the budget (100 bytes an image), least recently used out first.
    r.process((b"b",), decode, processor_call(r))
    r.process((b"a",), decode, processor_call(r))
    r.process((b"c",), decode, processor_call(r))
    assert cutter.calls == 3 and r.nbytes == 200
    r.process((b"a",), decode, processor_call(r))
    r.process((b"b",), decode, processor_call(r))
    assert cutter.calls == 4


def test_a_processor_that_does_not_ask_gets_the_real_images_and_nothing_is_kept():
    cutter = Cutter()
    r = Remembered(cutter)
    r.process((b"a",), lambda: ["img"], processor_call(r))

    def otherwise(images):  # makes its arrays without the image processor's __call__
        return images

    assert r.process((b"a",), lambda: ["img"], otherwise) == ["img"]
    assert r.nbytes == 0 and r.budget == 0
    r.process((b"a",), lambda: ["img"], processor_call(r))
    assert cutter.calls == 2 and r.nbytes == 0
