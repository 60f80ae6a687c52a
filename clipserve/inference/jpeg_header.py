"""A JPEG's header read up to its first scan, for the fast decode path: what `Image.open`,
`draft` and `getexif` would tell `preprocess.ImageDecoder` (size, mode, sampling, progressive,
EXIF orientation, the drafted size) in a quarter of the time Pillow takes (8 against 33 us on
a 640x480 photo; bench/jpeg_header.py, bench/results/jpeg-header.json).

The parser only answers where it is sure that Pillow would say the same: `read_header` returns
None for anything else (other SOF types, 12-bit, CMYK/YCCK, junk between markers, several SOFs
or EXIF segments, MPO, odd EXIF, segments Pillow's open would trip on), and the caller then
opens the file with Pillow as before, so decisions and errors can only match.
tests/inference/test_jpeg_header.py compares both on scikit-image's photos and on broken headers.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Layer = tuple[int, int, int, int]  # Pillow's JpegImageFile.layer: id, h and v sampling, table
Frame = tuple[tuple[int, int], tuple[Layer, ...], bool]  # size, layers, progressive

_BASELINE, _PROGRESSIVE = 0xC0, 0xC2
_SOS, _DQT, _DHT, _DRI = 0xDA, 0xDB, 0xC4, 0xDD
_COM = 0xFE
_SKIPPED = frozenset((_DHT, _DRI, _COM))  # Pillow skips them; the decoder reads DHT and DRI
_MARKER = struct.Struct(">BBH")  # 0xFF, the marker, the segment's length
_EXIF = b"Exif\x00\x00"
_XMP = b"http://ns.adobe.com/xap/1.0/\x00"
# Pillow's getexif takes the orientation from XMP where EXIF has none; its pattern.
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')
_ORIENTATION_TAG = 0x0112
_SHORT = 3
# TIFF field types -> bytes per value, as Pillow's ImageFileDirectory_v2 reads them (a test
# checks this against Pillow's table); other types Pillow skips.
TIFF_UNIT_SIZES = {
    1: 1,
    2: 1,
    3: 2,
    4: 4,
    5: 8,
    6: 1,
    7: 1,
    8: 2,
    9: 4,
    10: 8,
    11: 4,
    12: 8,
    13: 4,
    16: 8,
}


@dataclass(frozen=True)
class JpegHeader:
    """What Pillow's open (plus getexif) reports of a baseline or progressive 8-bit JPEG with
    one or three components."""

    size: tuple[int, int]  # width, height
    layers: tuple[Layer, ...]
    progressive: bool
    orientation: int  # EXIF (or XMP) orientation, 1 to 8

    @property
    def mode(self) -> str:
        return "L" if len(self.layers) == 1 else "RGB"


def drafted_size(size: tuple[int, int], target: int) -> tuple[int, int]:
    """The size Pillow's `draft(None, (target, target))` gives a JPEG of `size`: the largest
    DCT scale of 1/8, 1/4, 1/2 that keeps both sides at least `target`, sides rounded up."""
    width, height = size
    scale = min(width // target, height // target)
    s = 8 if scale >= 8 else 4 if scale >= 4 else 2 if scale >= 2 else 1
    return (width + s - 1) // s, (height + s - 1) // s


def coefficient_bytes(size: tuple[int, int], layers: Sequence[Layer]) -> int:
    """What a progressive JPEG's decode holds beside the raster: every DCT coefficient of the
    full-size image, 2 bytes each (3 per pixel at 4:2:0), whatever the draft scale. Largest
    sampling factors of 0 count as 1: libjpeg refuses such a file when it decodes it."""
    width, height = size
    h_max = max(1, max(h for _, h, _, _ in layers))
    v_max = max(1, max(v for _, _, v, _ in layers))
    samples = sum(h * v for _, h, v, _ in layers) / (h_max * v_max)
    return int(width * height * samples * 2)


def read_header(data: bytes) -> JpegHeader | None:
    """`data`'s header as Pillow would read it; None where the parser is not sure of that."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    pos, end = 2, len(data)
    frame: Frame | None = None
    exif: bytes | None = None
    xmp: bytes | None = None
    while True:
        if pos + 4 > end:
            return None
        ff, marker, length = _MARKER.unpack_from(data, pos)
        if ff != 0xFF:
            return None
        if marker == 0xFF:  # fill bytes before a marker
            pos += 1
            continue
        start, stop = pos + 4, pos + 2 + length
        if length < 2 or stop > end:
            return None
        pos = stop
        if marker in _SKIPPED:
            continue
        if marker == _SOS:
            break
        if marker in (_BASELINE, _PROGRESSIVE):
            if frame is not None:
                return None
            frame = _frame(data[start:stop], marker == _PROGRESSIVE)
            if frame is None:
                return None
        elif 0xE0 <= marker <= 0xEF:
            body = data[start:stop]
            if marker == 0xE1 and body.startswith(_EXIF):
                if exif is not None:  # Pillow joins them
                    return None
                exif = body[len(_EXIF) :]
            elif marker == 0xE1 and body.startswith(_XMP):
                xmp = body[len(_XMP) :]  # the last one counts, as in Pillow
            elif not _app_ok(marker, body):
                return None
        elif marker == _DQT:
            if not _dqt_ok(data, start, stop):
                return None
        else:
            return None  # other frames, arithmetic coding, DNL, markers without a length
    if frame is None:
        return None
    orientation = _orientation(exif, xmp)
    if orientation is None:
        return None
    size, layers, progressive = frame
    return JpegHeader(size, layers, progressive, orientation)


def _frame(body: bytes, progressive: bool) -> Frame | None:
    """SOF0/SOF2: 8-bit samples, 1 or 3 components, sampling factors 1 to 4."""
    if len(body) < 6 or body[0] != 8 or body[5] not in (1, 3) or len(body) != 6 + 3 * body[5]:
        return None
    height, width = int.from_bytes(body[1:3], "big"), int.from_bytes(body[3:5], "big")
    if width < 1 or height < 1:  # Pillow refuses these; DNL heights go its way too
        return None
    layers = tuple(
        (body[i], body[i + 1] >> 4, body[i + 1] & 15, body[i + 2]) for i in range(6, len(body), 3)
    )
    if any(not (1 <= h <= 4 and 1 <= v <= 4) for _, h, v, _ in layers):
        return None
    return (width, height), layers, progressive


def _app_ok(marker: int, body: bytes) -> bool:
    """Whether Pillow's APPn handler reads `body` without failing the open, and the file is
    a plain JPEG to it (no MPO, no YCCK)."""
    if marker == 0xE0:
        return not body.startswith(b"JFIF") or len(body) >= 7
    if marker == 0xE2:
        if body.startswith(b"MPF\x00"):
            return False  # Pillow may open it as MPO
        return not body.startswith(b"ICC_PROFILE\x00") or len(body) >= 14
    if marker == 0xED and body.startswith(b"Photoshop 3.0\x00"):
        return _photoshop_ok(body)
    if marker == 0xEE and body.startswith(b"Adobe"):
        return len(body) >= 7 and (len(body) < 12 or body[11] != 2)  # transform 2: YCCK
    return True


def _photoshop_ok(body: bytes) -> bool:
    """Pillow's walk of APP13's resource blocks: it stops quietly where a number is cut off,
    but fails the open where a block's name length is missing."""
    offset, end = 14, len(body)
    while body[offset : offset + 4] == b"8BIM":
        offset += 6  # signature and resource code
        if offset > end:
            return True
        if offset >= end:
            return False
        offset += 1 + body[offset]
        offset += offset & 1
        if offset + 4 > end:
            return True
        offset += 4 + int.from_bytes(body[offset : offset + 4], "big")
        offset += offset & 1
    return True


def _dqt_ok(data: bytes, start: int, stop: int) -> bool:
    """Pillow reads every quantization table and fails the open on a short one."""
    while start < stop:
        start += 65 if data[start] >> 4 == 0 else 129
        if start > stop:
            return False
    return True


def _orientation(exif: bytes | None, xmp: bytes | None) -> int | None:
    """Pillow's `getexif().get(Orientation, 1)`: IFD0's tag, else XMP's tiff:Orientation."""
    found = 0 if exif is None else _exif_orientation(exif)
    if found is None:
        return None
    if found == 0:
        match = None if xmp is None else _XMP_ORIENTATION.search(xmp)
        found = int(match[2]) if match else 1
    return found if 1 <= found <= 8 else None


def _exif_orientation(tiff: bytes) -> int | None:
    """Tag 0x0112 of IFD0 (0 where absent); None where anything is odd (Pillow would warn,
    skip or read it differently)."""
    order: Literal["little", "big"]
    if tiff.startswith(b"II*\x00"):
        order = "little"
    elif tiff.startswith(b"MM\x00*"):
        order = "big"
    else:
        return None
    end = len(tiff)
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > end:
        return None
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    if ifd + 2 + 12 * count + 4 > end:
        return None
    found, total = 0, 0
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        tag = int.from_bytes(tiff[entry : entry + 2], order)
        kind = int.from_bytes(tiff[entry + 2 : entry + 4], order)
        values = int.from_bytes(tiff[entry + 4 : entry + 8], order)
        if tag == _ORIENTATION_TAG:
            if found or kind != _SHORT or values != 1:
                return None
            found = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            if not 1 <= found <= 8:
                return None
            continue
        unit = TIFF_UNIT_SIZES.get(kind)
        size = 0 if unit is None else unit * values
        if size > 4:  # stored at an offset: Pillow warns and skips what lies past the end
            total += size
            if total > end or int.from_bytes(tiff[entry + 8 : entry + 12], order) + size > end:
                return None
    return found
