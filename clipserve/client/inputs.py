"""What callers pass as images, and turning each into what an engine embeds: encoded bytes, or
a uint8 HxWx3 array. Files are read here, so an unreadable one fails without a request."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from clipserve.errors import ClipserveError
from clipserve.inference.preprocess import ImageDecoder

ImageInput = str | os.PathLike[str] | bytes | np.ndarray  # a path, encoded bytes, HxWx3 uint8
Payload = bytes | np.ndarray  # an encoded image, or an HxWx3 uint8 array


class Unusable(Exception):
    """An input that will not be embedded, and why; `position` is its place in the batch that
    was sent, where the refusal came from a batch."""

    def __init__(self, reason: str, position: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.position = position


def source_of(item: ImageInput, index: int) -> str:
    """How messages name an input: its path, or its kind and place."""
    if isinstance(item, bytes | bytearray):
        return f"<bytes #{index}>"
    if isinstance(item, np.ndarray):
        return f"<array #{index}>"
    if isinstance(item, str | os.PathLike):
        return str(os.fspath(item))
    return f"<{type(item).__name__} #{index}>"  # not an image input: named by its type


def load(item: ImageInput) -> Payload:
    """A file's bytes, bytes as they are, an array once checked; Unusable if it is none."""
    if isinstance(item, bytes | bytearray):
        if not item:
            raise Unusable("empty image bytes")
        return bytes(item)
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or item.ndim != 3 or item.shape[2] != 3 or 0 in item.shape:
            raise Unusable(f"expected an HxWx3 uint8 array, got {item.dtype} {item.shape}")
        return item
    if not isinstance(item, str | os.PathLike):  # None, a PIL image: refused like a bad file
        raise Unusable(f"expected a path, bytes or an HxWx3 uint8 array, got {type(item).__name__}")
    try:
        data = Path(item).read_bytes()
    except OSError as e:
        raise Unusable(f"cannot read the file ({e.strerror or type(e).__name__})") from None
    if not data:
        raise Unusable("empty file")
    return data


def load_all(items: Sequence[ImageInput]) -> list[Payload | Unusable]:
    """`load` for each item, failures in place: blocking file reads, run it off the loop."""
    loaded: list[Payload | Unusable] = []
    for item in items:
        try:
            loaded.append(load(item))
        except Unusable as e:
            loaded.append(e)
    return loaded


def png(array: np.ndarray) -> bytes:
    """An array as a PNG: lossless, so the server decodes exactly these pixels."""
    out = io.BytesIO()
    Image.fromarray(array).save(out, "PNG", compress_level=1)
    return out.getvalue()


def crop(decoder: ImageDecoder, payload: Payload) -> np.ndarray:
    """The server's own decode and centre crop (uint8 HxWx3 at the model's input size); an
    array goes through the same steps, unless it already is that size."""
    if isinstance(payload, np.ndarray):
        if payload.shape[:2] == decoder.spec.size:
            return np.ascontiguousarray(payload)
        payload = png(payload)
    try:
        return decoder(payload)
    except ClipserveError as e:
        raise Unusable(e.message) from None
