"""Decode and crop images to uint8 HWC at the model's input size, parameters from open_clip.

The steps follow open_clip's eval transform (resize the shorter side, centre crop, then convert
to RGB) so the pixels match it; two shortcuts, both bounded by tests against open_clip itself:
JPEG draft mode (libjpeg DCT scaling) and Pillow's `reducing_gap` for large images.
Normalisation is not done here: it happens on the executor's device.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from clipserve.errors import ImageTooLarge, InvalidImage, StartupError

ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP")
_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
# Draft-decode JPEGs to at least this multiple of the target size, then resize properly: a
# smaller margin is faster but drifts further from open_clip (bench/results/decoders.json).
DRAFT_MARGIN = 1
# Pillow's reduce-then-resample shortcut; 3.0 is where its docs call results indistinguishable.
REDUCING_GAP = 3.0


@dataclass(frozen=True)
class PreprocessSpec:
    size: tuple[int, int]  # (height, width)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bicubic"
    resize_mode: str = "shortest"

    @classmethod
    def from_open_clip(cls, cfg: Mapping[str, Any]) -> PreprocessSpec:
        size = cfg.get("size", 224)
        hw = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
        spec = cls(
            size=hw,
            mean=tuple(float(v) for v in cfg["mean"]),  # type: ignore[arg-type]
            std=tuple(float(v) for v in cfg["std"]),  # type: ignore[arg-type]
            interpolation=str(cfg.get("interpolation", "bicubic")),
            resize_mode=str(cfg.get("resize_mode", "shortest")),
        )
        if spec.interpolation not in _RESAMPLE:
            raise StartupError(f"model preprocess: unsupported interpolation {spec.interpolation}")
        if spec.resize_mode == "shortest" and hw[0] != hw[1]:
            raise StartupError("model preprocess: 'shortest' resize with a non-square size")
        if spec.resize_mode not in ("shortest", "squash"):
            raise StartupError(f"model preprocess: unsupported resize_mode {spec.resize_mode}")
        return spec


def resized_size(width: int, height: int, spec: PreprocessSpec) -> tuple[int, int]:
    """(width, height) after the resize step, with torchvision's integer rounding."""
    th, tw = spec.size
    if spec.resize_mode == "squash":
        return tw, th
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = th, int(th * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def center_box(width: int, height: int, spec: PreprocessSpec) -> tuple[int, int, int, int]:
    th, tw = spec.size
    top = round((height - th) / 2.0)  # torchvision's CenterCrop rounding, half to even
    left = round((width - tw) / 2.0)
    return left, top, left + tw, top + th


class ImageDecoder:
    """Encoded image bytes → uint8 (H, W, 3) crop. Thread-safe; Pillow releases the GIL."""

    def __init__(self, spec: PreprocessSpec, max_pixels: int, *, fast: bool = True) -> None:
        self.spec = spec
        self.max_pixels = max_pixels
        self.fast = fast
        self._resample = _RESAMPLE[spec.interpolation]

    def __call__(self, data: bytes) -> np.ndarray:
        if not data:
            raise InvalidImage("empty image body")
        try:
            img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        except UnidentifiedImageError:
            raise InvalidImage("not a JPEG, PNG or WebP image") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageTooLarge("image dimensions exceed the decoder's safety limit") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise InvalidImage(f"unreadable image header ({e})") from None
        width, height = img.size
        if width * height > self.max_pixels:  # checked from the header, before any decode
            raise ImageTooLarge(
                f"{width}x{height} image has {width * height} pixels; "
                f"the limit is {self.max_pixels} (--max-image-pixels)"
            )
        if width < 1 or height < 1:
            raise InvalidImage(f"image has no pixels ({width}x{height})")
        try:
            return self._crop(img)
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise InvalidImage(f"truncated or corrupt image data ({e})") from None

    def _crop(self, img: Image.Image) -> np.ndarray:
        spec = self.spec
        if self.fast and img.format == "JPEG":
            target = max(spec.size) * DRAFT_MARGIN
            img.draft(None, (target, target))  # both sides stay >= target; EXIF swaps are safe
        img.load()
        if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            img = ImageOps.exif_transpose(img)
        width, height = img.size
        size = resized_size(width, height, spec)
        gap = REDUCING_GAP if self.fast else None
        img = img.resize(size, self._resample, reducing_gap=gap)
        if img.size != (spec.size[1], spec.size[0]):
            img = img.crop(center_box(*img.size, spec))
        if img.mode != "RGB":
            img = img.convert("RGB")
        return np.asarray(img, dtype=np.uint8)
