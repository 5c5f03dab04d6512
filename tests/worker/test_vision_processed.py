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



def test_two_threads_at_once_each_get_their_own_output():
    """The preparation threads run two requests at once (worker/loop/preparer.py): one
    whose image is known (its call hands the processor the kept output) and one whose
    image is new (a real run), both calling the processor at the same moment (a barrier
    holds each until the other is there): each gets its own output, and the new one's
    is kept. What a call hands the processor is the calling thread's."""
    import threading

    cutter = Cutter()
    r = Remembered(cutter, budget=1000)
    kept, _ = r.process((b"known",), lambda: ["img"], processor_call(r, pops=False))
    meet = threading.Barrier(2, timeout=30)

    def met(call):
        def wrapped(images):
            meet.wait()  # (the known one's kept output is handed over by now)
            return call(images)
        return wrapped

    got = {}

    def run(name):
        got[name] = r.process((name.encode(),), lambda: ["img"],
                              met(processor_call(r, pops=False)))

    threads = [threading.Thread(target=run, args=(n,)) for n in ("known", "new")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert (got["known"][0]["pixel_values"] == kept["pixel_values"]).all()
    assert got["known"][1][0].size == (1, 1) and got["new"][1] == ["img"]
    assert cutter.calls == 2 and (got["new"][0]["pixel_values"] == 2).all()
    assert r.hits == 1 and set(r._kept) == {(b"known",), (b"new",)}
    assert (r._kept[(b"new",)][0]["pixel_values"] == 2).all()
