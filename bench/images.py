"""Synthetic test images: smooth gradients, shapes and mild noise, JPEG-compressible like photos."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


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
