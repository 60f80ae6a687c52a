"""Images to send: synthetic ones (gradients, shapes, mild noise: JPEG-compressible like photos)
or the files of a directory."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            127 + 100 * np.sin(x / (width / (3 + seed % 3)) + y / height),
            127 + 100 * np.cos(y / (height / 4) - x / width * 2),
            127 + 90 * np.sin((x + y) / ((width + height) / 6)),
        ],
        axis=-1,
    )
    base += rng.normal(0, 6, base.shape)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(max(4, width // 40), max(8, width // 6)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=colour)
    return img.filter(ImageFilter.GaussianBlur(0.6))


def encode(img: Image.Image, fmt: str = "JPEG", **params: object) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        params.setdefault("quality", 90)
    img.save(buf, fmt, **params)
    return buf.getvalue()


def jpeg(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    return encode(synthetic_image(width, height, seed), "JPEG", quality=quality)


def parse_size(text: str) -> tuple[int, int]:
    """'640x480' → (640, 480): width first, as image sizes are usually written."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise ValueError(f"image size {text!r}: expected WIDTHxHEIGHT, e.g. 640x480")
    return int(w), int(h)


@dataclass(frozen=True)
class SourceImage:
    """An image to send, with its file's own bytes where it came from one (sent as they are
    when the payload kind carries that format)."""

    image: Image.Image
    data: bytes | None = None
    format: str | None = None  # JPEG, PNG, WEBP: Pillow's names


def load_images(directory: Path | None, size: tuple[int, int], count: int) -> list[SourceImage]:
    """Up to `count` images from `directory` (sorted by name), else `count` synthetic ones."""
    if directory is None:
        return [SourceImage(synthetic_image(size[0], size[1], seed)) for seed in range(count)]
    if not directory.is_dir():
        raise ValueError(f"--images {directory}: not a directory")
    files = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"--images {directory}: no .jpg/.jpeg/.png/.webp files")
    out = []
    for path in files[:count]:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            rgb = img.convert("RGB")
        out.append(SourceImage(rgb, data, fmt))
    return out
