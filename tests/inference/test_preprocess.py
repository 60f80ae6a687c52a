"""Decoding and cropping: parity with open_clip's own transform, and refusal of bad images."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image, ImageOps

from clipserve.backends.base import normalise_numpy
from clipserve.errors import ImageTooLarge, InvalidImage
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import encode, synthetic_image
from tests.helpers import png_chunk, with_orientation

CFG = PreprocessCfg(size=224)
SPEC = PreprocessSpec.from_open_clip(
    {"size": 224, "mean": CFG.mean, "std": CFG.std, "interpolation": "bicubic"}
)
# Stated tolerances for the fast path (JPEG draft decode + reducing_gap) against open_clip:
FAST_MEAN_PIXEL_DIFF = 1.5  # mean |difference| in levels of 255
FAST_MIN_COSINE = 0.999  # embedding cosine through the tiny test model


def reference_pixels(data: bytes) -> np.ndarray:
    """open_clip's eval transform after exif_transpose, stopped before ToTensor/Normalize."""
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    for step in image_transform_v2(CFG, is_train=False).transforms[:-2]:
        img = step(img)
    return np.asarray(img)


def cases() -> list[tuple[str, bytes]]:
    img = synthetic_image(640, 480, seed=3)
    out = [
        (f"jpeg-{w}x{h}", encode(synthetic_image(w, h, seed=w), "JPEG"))
        for w, h in [(224, 224), (300, 200), (200, 300), (1000, 250), (257, 255), (1920, 1080)]
    ]
    out += [
        ("jpeg-grey", encode(img.convert("L"), "JPEG")),
        ("jpeg-cmyk", encode(img.convert("CMYK"), "JPEG")),
        ("png-rgba", encode(img.convert("RGBA"), "PNG")),
        ("png-palette", encode(img.convert("P"), "PNG")),
        ("png-la", encode(img.convert("LA"), "PNG")),
        ("webp", encode(img, "WEBP", quality=90)),
    ]
    out += [(f"jpeg-exif-{o}", with_orientation(img, o)) for o in (3, 6, 8)]
    return out


CASES = cases()


@pytest.mark.parametrize(("name", "data"), CASES, ids=[c[0] for c in CASES])
def test_exact_path_is_pixel_identical_to_open_clip(name: str, data: bytes) -> None:
    ours = ImageDecoder(SPEC, 10**8, fast=False)(data)
    ref = reference_pixels(data)
    assert ours.shape == (224, 224, 3) and ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize(("name", "data"), CASES, ids=[c[0] for c in CASES])
def test_fast_path_stays_within_stated_tolerance(name: str, data: bytes, tiny_model: Any) -> None:
    ours = ImageDecoder(SPEC, 10**8, fast=True)(data)
    ref = reference_pixels(data)
    diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
    assert diff.mean() <= FAST_MEAN_PIXEL_DIFF, f"mean pixel diff {diff.mean():.3f}"
    with torch.inference_mode():
        x = torch.from_numpy(normalise_numpy(np.stack([ours, ref]), SPEC))
        a, b = tiny_model.encode_image(x, normalize=True)
    assert float(a @ b) >= FAST_MIN_COSINE


def test_exif_rotation_is_applied() -> None:
    img = synthetic_image(400, 240, seed=5)  # landscape
    upright = ImageDecoder(SPEC, 10**8, fast=False)(encode(img.rotate(90, expand=True), "PNG"))
    rotated = ImageDecoder(SPEC, 10**8, fast=False)(with_orientation(img, 8))
    assert np.abs(upright.astype(int) - rotated.astype(int)).mean() < 3  # only JPEG loss differs


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height; the pixel data is tiny (and incomplete)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("side", [7000, 60000])
def test_decompression_bomb_is_refused_from_the_header(side: int) -> None:
    with pytest.raises(ImageTooLarge, match=r"pixels|limit"):
        ImageDecoder(SPEC, 40_000_000)(png_header_only(side, side))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"hello, not an image", "not a JPEG, PNG or WebP"),
        (encode(synthetic_image(64, 64), "GIF"), "not a JPEG, PNG or WebP"),
        (encode(synthetic_image(640, 480), "JPEG")[:3000], "truncated or corrupt"),
        (encode(synthetic_image(640, 480), "PNG")[:5000], "truncated or corrupt"),
        (png_header_only(100, 100), "truncated or corrupt"),
    ],
    ids=["empty", "garbage", "gif", "truncated-jpeg", "truncated-png", "header-only-png"],
)
def test_bad_images_raise_invalid_image(data: bytes, message: str) -> None:
    with pytest.raises(InvalidImage, match=message):
        ImageDecoder(SPEC, 10**8)(data)


def _modes(width: int, height: int) -> list[tuple[str, bytes]]:
    img = synthetic_image(width, height, seed=7)
    grey16 = np.asarray(img.convert("L"), dtype=np.uint16) * 3  # above 255 too: clipped to white
    rgba = img.convert("RGBA")
    rgba.putalpha(img.convert("L"))
    size = f"{width}x{height}"
    return [
        (f"png-i16-{size}", encode(Image.fromarray(grey16), "PNG")),
        (f"png-1-{size}", encode(img.convert("1"), "PNG")),
        (f"png-l-{size}", encode(img.convert("L"), "PNG")),
        (f"png-la-{size}", encode(rgba.convert("LA"), "PNG")),
        (f"png-p-{size}", encode(img.convert("P"), "PNG", transparency=0)),
        (f"png-rgba-{size}", encode(rgba, "PNG")),
        (f"jpeg-cmyk-{size}", encode(img.convert("CMYK"), "JPEG")),
        (f"webp-rgba-{size}", encode(rgba, "WEBP", lossless=True)),
    ]


# Small, mid-size, and large enough for JPEG draft and Pillow's reduce() to take part.
MODE_CASES = [case for w, h in [(64, 48), (300, 200), (2000, 1500)] for case in _modes(w, h)]


@pytest.mark.parametrize(("name", "data"), MODE_CASES, ids=[c[0] for c in MODE_CASES])
def test_every_mode_matches_open_clip_at_every_size(name: str, data: bytes) -> None:
    """open_clip resizes in the decoded mode and converts to RGB after the crop (I;16 values
    over 255 become 255); the exact path does the same, the fast path stays within tolerance.
    2000x1500 I;16 used to be refused: Pillow's reduce() has no 16-bit modes."""
    ref = reference_pixels(data)
    np.testing.assert_array_equal(ImageDecoder(SPEC, 10**8, fast=False)(data), ref)
    fast = ImageDecoder(SPEC, 10**8, fast=True)(data)
    diff = np.abs(fast.astype(np.int16) - ref.astype(np.int16))
    assert diff.mean() <= FAST_MEAN_PIXEL_DIFF, f"mean pixel diff {diff.mean():.3f}"


@pytest.mark.parametrize("size", [(30, 6000), (6000, 30), (100, 9000)])
def test_region_resize_of_thin_images_matches_open_clip(size: tuple[int, int]) -> None:
    """Past MAX_RESIZED_PIXELS only the crop's source region is resized; open_clip's full
    resize (here 224 x 44,800 at most) gives the same pixels within the fast tolerance."""
    data = encode(synthetic_image(*size, seed=11), "PNG")
    ref = reference_pixels(data)
    for fast in (False, True):
        ours = ImageDecoder(SPEC, 10**8, fast=fast)(data)
        diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
        assert diff.mean() <= FAST_MEAN_PIXEL_DIFF and diff.max() <= 8, (fast, diff.max())


@pytest.mark.parametrize("read_headers", [True, False])
def test_progressive_jpeg_with_zero_sampling_factors_is_invalid(read_headers: bool) -> None:
    """decode_bytes divided by the largest sampling factor: 0 raised ZeroDivisionError (a 500)."""
    data = bytearray(encode(synthetic_image(64, 48, seed=2), "JPEG", progressive=True))
    sof = data.index(b"\xff\xc2")
    for component in range(data[sof + 9]):
        data[sof + 11 + 3 * component] = 0
    with pytest.raises(InvalidImage, match="truncated or corrupt"):
        ImageDecoder(SPEC, 10**8, read_headers=read_headers)(bytes(data))
