"""Decode and crop images to uint8 HWC at the model's input size, parameters from open_clip.

The steps follow open_clip's eval transform (resize the shorter side, centre crop, then convert
to RGB) so the pixels match it; shortcuts, all bounded by tests against open_clip itself: JPEG
draft mode (libjpeg DCT scaling), Pillow's `reducing_gap` for large images, and where installed
the fast JPEG path of inference/jpeg.py (simplejpeg's decode, torch's resize).
Normalisation is not done here: it happens on the executor's device.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from clipserve.config import JPEG_SCALINGS, LimitsConfig
from clipserve.errors import ImageTooLarge, InvalidImage, StartupError
from clipserve.inference.jpeg import PILLOW, FastJpeg, fast_jpeg, orient
from clipserve.inference.jpeg_header import JpegHeader, coefficient_bytes, drafted_size, read_header
from clipserve.protocol.urls import is_url, url_refused

ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP")
_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
# Draft-decode JPEGs (libjpeg's DCT scaling, 1/2 to 1/8) to at least this multiple of the target
# size, then resize properly. The DCT's scaling keeps detail that open_clip's antialiased resize
# softens; with little resize left after it the crop comes out sharper than open_clip's: at 1,
# motorcycle_left (741x500 -> 371x250 -> 224) is 4.7 levels off, cosine 0.990; at 2, within 0.5
# level on scikit-image's photos (tests/inference/test_jpeg.py, bench/results/jpeg-decoders.json).
DRAFT_MARGIN = 2
# --jpeg-scaling: parity is DRAFT_MARGIN; fast is Pillow draft's own margin (how the server
# decoded before the fast path). At 640x480, which parity decodes in full, fast serves ~1.5x the
# JPEGs per core (bench/results/jpeg-decoders.json, round_6).
FAST_DRAFT_MARGIN = 1
# Pillow's reduce-then-resample shortcut; 3.0 is where its docs call results indistinguishable.
REDUCING_GAP = 3.0
# open_clip resizes the whole image, then crops. We do the same (pixel-exact) while the resized
# image stays within this many pixels (aspect ratios up to ~80:1 at 224); beyond, only the
# region the crop keeps is resized, so tall or thin images cannot allocate gigabytes.
MAX_RESIZED_PIXELS = 1 << 22
DEFAULT_MAX_DECODE_BYTES: int = LimitsConfig.max_decode_bytes  # the flags' defaults: one source
DEFAULT_MAX_ASPECT: float = LimitsConfig.max_image_aspect
# Container structure that costs time or memory out of proportion to its bytes, counted before
# Pillow parses it (Pillow walks markers and chunks in Python, one by one). Real files stay far
# below: libjpeg writes 10 scans and ~20 segments, libpng one IDAT per 8 KiB.
MAX_JPEG_SCANS = 100  # each progressive scan re-reads every block: 1,000 tiny scans took 18 s
MAX_JPEG_SEGMENTS = 1000  # 1,000,000 empty APP segments (4 MB) took 2.6 s and 130 MB
MAX_PNG_CHUNKS = 16384  # 1,000,000 empty chunks (12 MB) took 7-13 s
MAX_PNG_TEXT_CHUNKS = 16  # Pillow inflates each zTXt/iTXt to 1 MiB: 1 KB each on the wire
MAX_WEBP_CHUNKS = 16384  # animated WebP: one chunk per frame
# Pillow parses EXIF in Python holding the GIL: a 786 KB PNG eXIf (65,535 entries) took 0.35 s.
# JPEG's APP1 segment caps EXIF at 64 KiB; PNG and WebP get the same cap.
MAX_EXIF_BYTES = 65535


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
            mean=_per_channel(cfg["mean"]),
            std=_per_channel(cfg["std"]),
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


def _per_channel(values: Iterable[float]) -> tuple[float, float, float]:
    """An RGB mean or std from open_clip's config."""
    r, g, b = (float(v) for v in values)
    return r, g, b


def raster_bytes(img: Image.Image) -> int:
    """Bytes Pillow holds for `img`'s pixels: 1 per pixel for 1/L/P, 2 for I;16, else 4, and a
    pointer per row (a 1 x 40,000,000 image holds 160 MB of pixels and 320 MB of pointers)."""
    return _raster(img.size, img.mode)


def _raster(size: tuple[int, int], mode: str) -> int:
    width, height = size
    per_pixel = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    return height * (width * per_pixel + 8)


def decode_bytes(img: Image.Image, full_size: tuple[int, int] | None = None) -> int:
    """Estimated peak bytes to decode and resize `img` (opened, not loaded; JPEG draft set,
    `full_size` its size before the draft).

    Measured on Pillow 13 (6000 x 6666 images): PNG and baseline JPEG hold the raster once;
    progressive JPEG also holds every DCT coefficient of the full-size image (2 bytes each, 3
    per pixel at 4:2:0, whatever the draft scale); WebP holds the raster four times over
    (libwebp's canvas, the frame bytes, Pillow's copy). Resizing LA/RGBA premultiplies a copy.
    """
    raster = raster_bytes(img)
    total = raster * (4 if img.format == "WEBP" else 1)
    if img.mode in ("LA", "RGBA"):
        total += raster
    layers = getattr(img, "layer", None)
    if img.format == "JPEG" and img.info.get("progressive") and layers:
        total += coefficient_bytes(full_size or img.size, layers)
    return total


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The next marker after entropy-coded data: 0xFF (fill bytes allowed) followed by anything but
# a stuffed zero or a restart marker.
_JPEG_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_BOUND_CHUNK = 1 << 17  # bytes the structure check's bound counts at a time
_BOUND_MAX_BYTES = 1 << 19  # larger JPEGs are walked without trying the bound


def check_structure(data: bytes) -> None:
    """Refuse files whose marker or chunk counts or EXIF size exceed the limits above; a walk
    over headers only, O(limit) however the file is built."""
    if data.startswith(b"\xff\xd8"):
        _check_jpeg(data)
    elif data.startswith(_PNG_SIGNATURE):
        _check_png(data)
    elif data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        _check_webp(data)


def _check_exif(size: int, fmt: str) -> None:
    if size > MAX_EXIF_BYTES:
        raise InvalidImage(f"{fmt} EXIF of {size} bytes; at most {MAX_EXIF_BYTES} are read")


def _check_jpeg(data: bytes) -> None:
    pos, scans, segments, end = 2, 0, 0, len(data)
    bounded = False
    while pos + 4 <= end:
        if data[pos] != 0xFF or data[pos + 1] == 0xFF:  # entropy-coded data or fill bytes
            if not bounded:  # the headers are walked: can the rest reach a limit at all?
                bounded = True
                if _rest_within_limits(data, pos, scans, segments):
                    return
            found = _JPEG_NEXT_MARKER.search(data, pos)
            if found is None:
                return
            pos = found.start()
            continue
        marker = data[pos + 1]
        if marker == 0xD9:  # end of image
            return
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise InvalidImage(f"JPEG has more than {MAX_JPEG_SEGMENTS} marker segments")
        if 0xD0 <= marker <= 0xD7 or marker in (0x01, 0xD8):  # no length field
            pos += 2
            continue
        if marker == 0xDA:
            scans += 1
            if scans > MAX_JPEG_SCANS:
                raise InvalidImage(f"JPEG has more than {MAX_JPEG_SCANS} scans")
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")


def _rest_within_limits(data: bytes, pos: int, scans: int, segments: int) -> bool:
    """Whether the walk from `pos` on cannot pass the limits, counted at numpy's speed (about
    half the walk's regex scan; bytes.count is no faster than the regex on CPython 3.11).

    Exact upper bounds: every segment the walk counts from here on sits on its own 0xFF byte
    with a byte after it, and every scan on its own 0xFF 0xDA pair. Stuffed zeros and restart
    markers cannot be left out: where a segment's length lands the walk on 0xFF 0x00 or a
    restart marker, it counts that as a segment too (tests/inference/test_jpeg_header.py).
    Past _BOUND_MAX_BYTES a photo's stuffed zeros alone pass the segment limit (a 1 MB
    4000x3000 photo has 1,370 0xFF bytes, a 290 KB 1920x1080 one 755): such files go straight
    to the walk. Counted in chunks, so that the temporary arrays stay small, and a file with
    many 0xFF bytes goes to the walk after its first."""
    rest = np.frombuffer(data, np.uint8, offset=pos)
    if rest.size > _BOUND_MAX_BYTES:
        return False
    for start in range(0, rest.size - 1, _BOUND_CHUNK):
        part = rest[start : start + _BOUND_CHUNK + 1]  # one byte more: pairs across chunks
        ff = part[:-1] == 0xFF
        segments += int(np.count_nonzero(ff))
        scans += int(np.count_nonzero(ff & (part[1:] == 0xDA)))
        if segments > MAX_JPEG_SEGMENTS or scans > MAX_JPEG_SCANS:
            return False
    return True


def _check_png(data: bytes) -> None:
    pos, chunks, texts, end = len(_PNG_SIGNATURE), 0, 0, len(data)
    while pos + 8 <= end:
        kind = data[pos + 4 : pos + 8]
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise InvalidImage(f"PNG has more than {MAX_PNG_CHUNKS} chunks")
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            texts += 1
            if texts > MAX_PNG_TEXT_CHUNKS:
                raise InvalidImage(f"PNG has more than {MAX_PNG_TEXT_CHUNKS} text chunks")
        if kind == b"IEND":
            return
        length = int.from_bytes(data[pos : pos + 4], "big")
        if kind == b"eXIf":
            _check_exif(length, "PNG")
        pos += 12 + length


def _check_webp(data: bytes) -> None:
    pos, chunks, end = 12, 0, len(data)
    while pos + 8 <= end:
        chunks += 1
        if chunks > MAX_WEBP_CHUNKS:
            raise InvalidImage(f"WebP has more than {MAX_WEBP_CHUNKS} chunks")
        length = int.from_bytes(data[pos + 4 : pos + 8], "little")
        if data[pos : pos + 4] == b"EXIF":
            _check_exif(length, "WebP")
        pos += 8 + length + (length & 1)  # chunks are padded to even sizes


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
    """Encoded image bytes → uint8 (H, W, 3) crop. Thread-safe; Pillow releases the GIL.

    What one decode may allocate is bounded from the header, before any pixel is decoded:
    `max_pixels` (width x height) and `max_bytes` (`decode_bytes`: the decoded mode's bytes per
    pixel, times the copies the format's decoder and the resize make) and `max_aspect`.
    `jpeg` is the fast JPEG path ("auto": inference/jpeg.py's where installed; None: Pillow);
    it runs only where `fast`, after the same checks, and hands Pillow any file it cannot take.
    `draft_margin` (default DRAFT_MARGIN) is for parity and speed measurements, and so is
    `read_headers=False`, which opens every JPEG with Pillow: by default a JPEG that the fast
    path takes has its header read by inference/jpeg_header.py, with the same decisions.
    """

    def __init__(
        self,
        spec: PreprocessSpec,
        max_pixels: int,
        *,
        max_bytes: int = DEFAULT_MAX_DECODE_BYTES,
        max_aspect: float = DEFAULT_MAX_ASPECT,
        fast: bool = True,
        jpeg: FastJpeg | Literal["auto"] | None = "auto",
        draft_margin: int | None = None,
        read_headers: bool = True,
        jpeg_scaling: str = "parity",
    ) -> None:
        self.spec = spec
        self.max_pixels = max_pixels
        self.max_bytes = max_bytes
        self.max_aspect = max_aspect
        self.fast = fast
        self.read_headers = read_headers
        self._resample = _RESAMPLE[spec.interpolation]
        if jpeg_scaling not in JPEG_SCALINGS:
            raise ValueError(f"jpeg_scaling must be one of {JPEG_SCALINGS}, not {jpeg_scaling!r}")
        self.jpeg_scaling = jpeg_scaling  # --jpeg-scaling, for /info
        # The module's margins are read here, not bound as defaults: benchmarks set them.
        if draft_margin is None:
            draft_margin = FAST_DRAFT_MARGIN if jpeg_scaling == "fast" else DRAFT_MARGIN
        self.draft_margin = draft_margin
        self._jpeg = (fast_jpeg() if jpeg == "auto" else jpeg) if fast else None
        self.jpeg_decoder = self._jpeg.name if self._jpeg else PILLOW  # for /info and logs

    @classmethod
    def from_limits(
        cls, spec: PreprocessSpec, limits: LimitsConfig, jpeg_scaling: str = "parity"
    ) -> ImageDecoder:
        """The server's decoder: the input limits, and --jpeg-scaling's draft margin."""
        return cls(
            spec,
            limits.max_image_pixels,
            max_bytes=limits.max_decode_bytes,
            max_aspect=limits.max_image_aspect,
            jpeg_scaling=jpeg_scaling,
        )

    def __call__(self, data: bytes) -> np.ndarray:
        self._screen(data)
        header = self._header(data)
        if header is not None:
            self._check_size(*header.size)
        try:
            if header is not None:
                crop = self._crop_header(header, data)
                if crop is not None:
                    return crop
            # The fast decoder already said no to a parsed header's file: Pillow decodes it.
            return self._crop(self._open(data), data, fast_jpeg=header is None)
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise InvalidImage(f"truncated or corrupt image data ({e})") from None

    def open(self, data: bytes) -> Image.Image:
        """The header checks every decoder shares (structure, format, pixels, aspect), before
        any pixel is decoded; the image comes back opened, not loaded."""
        self._screen(data)
        return self._open(data)

    def _screen(self, data: bytes) -> None:
        if not data:
            raise InvalidImage("empty image body")
        if is_url(data):
            raise url_refused()
        check_structure(data)

    def _open(self, data: bytes) -> Image.Image:
        try:
            img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        except UnidentifiedImageError:
            raise InvalidImage("not a JPEG, PNG or WebP image") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageTooLarge("image dimensions exceed the decoder's safety limit") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise InvalidImage(f"unreadable image header ({e})") from None
        self._check_size(*img.size)
        return img

    def _header(self, data: bytes) -> JpegHeader | None:
        """A JPEG's header from inference/jpeg_header.py where the fast decoder runs and the
        parser is sure of it, so `Image.open` is skipped; None sends the file to Pillow. Sizes
        past Pillow's decompression-bomb limit go to Pillow too: it warns or refuses them."""
        if self._jpeg is None or not self.read_headers:
            return None
        header = read_header(data)
        bomb = Image.MAX_IMAGE_PIXELS
        if header is None or (bomb is not None and header.size[0] * header.size[1] > bomb):
            return None
        return header

    def _check_size(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:  # checked from the header, before any decode
            raise ImageTooLarge(
                f"{width}x{height} image has {width * height} pixels; "
                f"the limit is {self.max_pixels} (--max-image-pixels)"
            )
        if width < 1 or height < 1:
            raise InvalidImage(f"image has no pixels ({width}x{height})")
        if max(width, height) > self.max_aspect * min(width, height):
            # Bounds the work per pixel too: decoding costs per row as well as per pixel.
            raise InvalidImage(
                f"{width}x{height} image has an aspect ratio over {self.max_aspect:g}:1 "
                "(--max-image-aspect)"
            )

    def _check_bytes(
        self, needed: int, size: tuple[int, int], fmt: str | None, mode: str, why: str = ""
    ) -> None:
        if needed > self.max_bytes:
            width, height = size
            raise ImageTooLarge(
                f"decoding this {width}x{height} {fmt} image ({mode}{why}) takes "
                f"about {needed >> 20} MiB; the limit is {self.max_bytes >> 20} MiB "
                "(--max-decode-bytes)"
            )

    def _crop(self, img: Image.Image, data: bytes, fast_jpeg: bool = True) -> np.ndarray:
        spec = self.spec
        full_size = img.size
        if self.fast and img.format == "JPEG":
            target = max(spec.size) * self.draft_margin
            img.draft(None, (target, target))  # both sides stay >= target; EXIF swaps are safe
        # The drafted image bounds the fast path too: the same DCT scale, and 3 bytes per pixel
        # to Pillow's 4. Pillow decodes what libjpeg calls corrupt data (its warnings are
        # silenced, and Pillow 13 exposes none of them): only the fast path refuses it.
        needed = decode_bytes(img, full_size)
        self._check_bytes(needed, img.size, img.format, img.mode)
        jpeg = self._jpeg if fast_jpeg else None
        if jpeg is not None and img.format == "JPEG" and img.mode in ("RGB", "L"):
            orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
            crop = self._crop_jpeg(jpeg, data, img.size, img.mode, orientation, needed)
            if crop is not None:
                return crop
        img.load()
        if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            # The transposed copy sits beside the decoded image until the function returns.
            needed = decode_bytes(img, full_size) + raster_bytes(img)
            self._check_bytes(needed, img.size, img.format, img.mode, ", EXIF-rotated")
            img = ImageOps.exif_transpose(img)
        width, height = img.size
        size = resized_size(width, height, spec)
        # Pillow's reduce() has no 16-bit modes; without it the result is open_clip's exactly.
        gap = REDUCING_GAP if self.fast and not img.mode.startswith("I;16") else None
        if size[0] * size[1] <= MAX_RESIZED_PIXELS:
            img = img.resize(size, self._resample, reducing_gap=gap)
            if img.size != (spec.size[1], spec.size[0]):
                img = img.crop(center_box(*img.size, spec))
        else:
            img = self._resize_crop_box(img, size, gap)
        if img.mode != "RGB":
            img = img.convert("RGB")  # as open_clip's transform does, after the crop
        return np.asarray(img, dtype=np.uint8)

    def _crop_header(self, header: JpegHeader, data: bytes) -> np.ndarray | None:
        """`_crop`'s JPEG steps from a parsed header: Pillow's draft scale and decode_bytes'
        estimate, computed rather than read from an opened image."""
        assert self._jpeg is not None  # _header parses only where the fast decoder runs
        drafted = drafted_size(header.size, max(self.spec.size) * self.draft_margin)
        needed = _raster(drafted, header.mode)
        if header.progressive:
            needed += coefficient_bytes(header.size, header.layers)
        self._check_bytes(needed, drafted, "JPEG", header.mode)
        return self._crop_jpeg(self._jpeg, data, drafted, header.mode, header.orientation, needed)

    def _crop_jpeg(
        self,
        jpeg: FastJpeg,
        data: bytes,
        drafted: tuple[int, int],
        mode: str,
        orientation: int,
        needed: int,
    ) -> np.ndarray | None:
        """The fast path (inference/jpeg.py) for a JPEG whose draft's DCT scale gives `drafted`
        and whose decode `needed` bytes; None where its decoder cannot take the file (Pillow
        then decodes it). Corrupt data raises InvalidImage. The crop may be a view with strided
        rows: its consumers copy it once (the batch's stack, a shared-memory slot)."""
        if orientation != 1:
            rotated = needed + _raster(drafted, mode)
            self._check_bytes(rotated, drafted, "JPEG", mode, ", EXIF-rotated")
        width, height = drafted  # draft's DCT scale, as the fast decoder will pick it
        if orientation in (5, 6, 7, 8):
            width, height = height, width
        size = resized_size(width, height, self.spec)
        decoded = jpeg.decode(data, drafted, min(width / size[0], height / size[1]))
        if decoded is None:
            return None
        array = orient(decoded, orientation)
        if array.shape[1::-1] != (width, height):  # a decoder that picked another scale
            size = resized_size(array.shape[1], array.shape[0], self.spec)
        if size[0] * size[1] > MAX_RESIZED_PIXELS:
            region = self._resize_crop_box(Image.fromarray(array), size, REDUCING_GAP)
            return np.asarray(region, dtype=np.uint8)
        return jpeg.resize_crop(array, size, center_box(*size, self.spec), self.spec.interpolation)

    def _resize_crop_box(
        self, img: Image.Image, size: tuple[int, int], gap: float | None
    ) -> Image.Image:
        """Resize only the source region the centre crop keeps (plus the filter's reach).

        open_clip resizes the whole image first: for a 1 x 40,000,000 image that is 224 x
        8,960,000,000 pixels. The region gives the same crop up to Pillow's float32 box
        coordinates (within the fast path's tolerance), in memory bounded by the crop size.
        """
        th, tw = self.spec.size
        width, height = img.size
        left, top, right, bottom = center_box(*size, self.spec)
        sx, sy = width / size[0], height / size[1]
        box = (left * sx, top * sy, right * sx, bottom * sy)
        # Bicubic reads 2 source pixels either side per output pixel when upscaling, 2 x scale
        # when downscaling; one more for rounding.
        mx, my = math.ceil(2 * max(sx, 1.0)) + 1, math.ceil(2 * max(sy, 1.0)) + 1
        x0, y0 = max(0, int(box[0]) - mx), max(0, int(box[1]) - my)
        x1, y1 = min(width, math.ceil(box[2]) + mx), min(height, math.ceil(box[3]) + my)
        region = img.crop((x0, y0, x1, y1))
        shifted = (box[0] - x0, box[1] - y0, box[2] - x0, box[3] - y0)
        return region.resize((tw, th), self._resample, box=shifted, reducing_gap=gap)
