"""A vision request's images: bounded by their pixels before any is decoded, then decoded
no larger than the model's processor keeps.

An image's bytes say little about its pixels: a 20 KB PNG of 13,000 × 13,000 one-bit
pixels decodes to 169 MB, and the processor's arrays made of it to over 2 GB, only for the
processor to shrink it to a few thousand pixels (issue 30). So each image's size is read
from its header (PIL's `Image.open` reads no pixel) and the request is refused before
anything is decoded when one image, or all of them together, are over the bounds its
model's processor sets (`Limits`):

- the processor keeps at most `side` pixels of an image's shorter side (read from its
  config: `kept_side`), shrinking anything larger;
- one image may hold up to OVERSIZE × side² pixels (a JPEG decodes at down to 1/8 of each
  side, so up to there it costs about what the processor keeps), never fewer than FLOOR
  (a photo as a phone camera takes it is always taken, however small the model's images)
  and never more than CEILING (whatever the processor says, or when it says nothing);
- a request's images together, REQUEST_IMAGES images at the per-image bound.

An image larger than the processor keeps is decoded smaller: a JPEG at 1/2, 1/4 or 1/8 of
each side (`draft`), any image reduced by a whole factor (`Image.reduce`) right after
decoding, both sides staying at least `side`, so the processor's own resize only ever
shrinks and gives the size it would give from the whole image.

These bounds are the worker's because they are the processor's, which only the worker
loads (a request may arrive before the model has); the supervisor checks the images'
count and bytes (supervisor/api/fields/media.py) and reads no image. They replace PIL's
decompression-bomb limit in this process (`Image.MAX_IMAGE_PIXELS`): theirs is higher
than CEILING, and it raises without the size for what is far over it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from math import isqrt

from PIL import Image

from protocol.messages import INVALID_REQUEST
from worker.errors import RequestError

Image.MAX_IMAGE_PIXELS = None  # the bounds below are checked instead, with the size

CEILING = 8192 * 8192   # pixels of one image, whatever the model (about 64 megapixels)
FLOOR = 4096 * 4096     # pixels of one image any vision model takes (about 16 megapixels)
OVERSIZE = 64           # JPEG's smallest draft: 1/8 of each side
REQUEST_IMAGES = 4      # a request's pixels: this many images at the per-image bound
MAX_SIDE = 1 << 14      # a processor "edge" longer than this is an area (Qwen-VL's sizes)
_TILES = ("max_image_tiles", "pan_and_scan_max_num_crops", "max_patches")
# Modes Image.reduce takes; others are made RGB first.
_REDUCIBLE = ("L", "LA", "RGB", "RGBA", "CMYK", "YCbCr", "I", "F")


def kept_side(image_processor) -> int | None:
    """The longest shorter side an image keeps through `image_processor` (as mlx-vlm loads
    it), from its config: the largest of its sizes (`max_pixels` and an edge over MAX_SIDE
    are areas: their square root; `shortest_edge` only where no `longest_edge` caps it),
    times its tile or crop count where it cuts an image into several. Larger than the
    truth rather than smaller: an image is then decoded larger, never smaller, than the
    processor keeps. None when the config names no size."""
    sides = []

    def add(value, area: bool = False) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            value = int(value)
            sides.append(isqrt(value) if area or value > MAX_SIDE else value)

    add(getattr(image_processor, "max_pixels", None), area=True)
    for name in ("size", "crop_size", "max_image_size"):
        size = getattr(image_processor, name, None)
        if not hasattr(size, "get"):
            add(size)
            continue
        for key in ("height", "width", "longest_edge", "max_height", "max_width"):
            add(size.get(key))
        if size.get("longest_edge") is None:
            add(size.get("shortest_edge"))
        add(size.get("max_pixels"), area=True)
    for pinpoint in getattr(image_processor, "image_grid_pinpoints", None) or ():
        for value in pinpoint if isinstance(pinpoint, (list, tuple)) else ():
            add(value)
    if not sides:
        return None
    tiles = [t for t in (getattr(image_processor, n, None) for n in _TILES)
             if isinstance(t, int) and not isinstance(t, bool) and t > 1]
    return max(sides) * max(tiles, default=1)


@dataclass(frozen=True)
class Limits:
    """A model's image bounds (the module's docstring says why these)."""
    side: int | None    # the shorter side the processor keeps; None: unknown
    per_image: int      # pixels
    per_request: int    # pixels, all of a request's images together

    @classmethod
    def of(cls, image_processor) -> "Limits":
        return cls.for_side(kept_side(image_processor))

    @classmethod
    def for_side(cls, side: int | None) -> "Limits":
        per_image = CEILING if side is None else min(CEILING, max(FLOOR, OVERSIZE * side * side))
        return cls(side, per_image, REQUEST_IMAGES * per_image)


def _undecodable(i: int, e: Exception) -> RequestError:
    return RequestError(INVALID_REQUEST, f"image {i + 1} of the request could not be decoded "
                        f"as an image ({type(e).__name__})", "messages")


def open_images(data: tuple[bytes, ...], limits: Limits) -> list:
    """The request's images opened (headers read, no pixel decoded), within `limits`: a
    400 naming the first image over the per-image bound, or the request's pixels over the
    per-request one, or the image that is no image PIL knows."""
    opened, total = [], 0
    for i, raw in enumerate(data):
        try:
            img = Image.open(io.BytesIO(raw))
        except Exception as e:  # PIL raises many types for bad input: all the client's
            raise _undecodable(i, e) from None
        w, h = img.size
        if w * h > limits.per_image:
            kept = (f"; its processor keeps at most {limits.side}x{limits.side}"
                    if limits.side else "")
            raise RequestError(INVALID_REQUEST, f"image {i + 1} of the request is {w}x{h} = "
                               f"{w * h:,} pixels, over this model's bound of "
                               f"{limits.per_image:,} pixels per image{kept}: send it smaller",
                               "messages")
        total += w * h
        opened.append(img)
    if total > limits.per_request:
        raise RequestError(INVALID_REQUEST, f"the request's {len(data)} images hold {total:,} "
                           f"pixels together, over this model's bound of "
                           f"{limits.per_request:,} pixels per request: send fewer or smaller "
                           "images", "messages")
    return opened


def decode(img, side: int | None):
    """An opened image decoded as RGB, shrunk by a whole factor (JPEG: while decoding)
    where both its sides stay at least `side` (None: decoded whole)."""
    if side and min(img.size) >= 2 * side:
        img.draft(None, (side, side))  # JPEG only (others ignore it): 1/2, 1/4 or 1/8
    img.load()
    factor = min(img.size) // side if side else 1
    if factor >= 2:
        if img.mode not in _REDUCIBLE:
            img = img.convert("RGB")
        img = img.reduce(factor)
    return img.convert("RGB")


def decode_images(data: tuple[bytes, ...], limits: Limits) -> list:
    """The request's images as RGB PIL images, each no larger than the processor keeps,
    after `open_images` checked them all; a 400 naming the one that does not decode."""
    out = []
    for i, img in enumerate(open_images(data, limits)):
        try:
            out.append(decode(img, limits.side))
        except Exception as e:  # truncated or corrupt data, an unsupported mode, ...
            raise _undecodable(i, e) from None
    return out
