"""The cheap JPEG header work of the fast path, against what it replaces: the structure check's
counting bound against the full marker walk, and inference/jpeg_header.py against Pillow's
open, draft and getexif (same answers, same crops, same errors)."""

from __future__ import annotations

import functools
import io
import random
import re
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import ExifTags, Image, TiffImagePlugin

from clipserve.errors import ClipserveError, InvalidImage
from clipserve.inference import preprocess
from clipserve.inference.jpeg import fast_jpeg
from clipserve.inference.jpeg_header import TIFF_UNIT_SIZES, drafted_size, read_header
from clipserve.inference.preprocess import (
    MAX_JPEG_SCANS,
    MAX_JPEG_SEGMENTS,
    ImageDecoder,
    PreprocessSpec,
    check_structure,
)
from tests.helpers import with_orientation

skimage_data = pytest.importorskip("skimage.data")

SPEC = PreprocessSpec((224, 224), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
SOI, EOI, SOS = b"\xff\xd8", b"\xff\xd9", b"\xff\xda"


def segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def insert(data: bytes, *segments: bytes) -> bytes:
    """`data` with `segments` right after its SOI."""
    return data[:2] + b"".join(segments) + data[2:]


def encode(img: Image.Image, **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **params)
    return buf.getvalue()


# ---- the structure check's bound -------------------------------------------------------------

_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def walk_reference(data: bytes) -> None:
    """The marker walk as it was before the counting bound: the specification."""
    pos, scans, segments, end = 2, 0, 0, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF or data[pos + 1] == 0xFF:
            found = _NEXT_MARKER.search(data, pos)
            if found is None:
                return
            pos = found.start()
            continue
        marker = data[pos + 1]
        if marker == 0xD9:
            return
        segments += 1
        if segments > preprocess.MAX_JPEG_SEGMENTS:
            raise InvalidImage(f"JPEG has more than {preprocess.MAX_JPEG_SEGMENTS} marker segments")
        if 0xD0 <= marker <= 0xD7 or marker in (0x01, 0xD8):
            pos += 2
            continue
        if marker == 0xDA:
            scans += 1
            if scans > preprocess.MAX_JPEG_SCANS:
                raise InvalidImage(f"JPEG has more than {preprocess.MAX_JPEG_SCANS} scans")
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")


def verdict(check: Callable[[bytes], None], data: bytes) -> str:
    try:
        check(data)
    except ClipserveError as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


SCAN = segment(0xDA, b"\x01\x01\x00\x00\x3f\x00") + b"\x12\x34\xff\x00\x56"


def structure_cases() -> dict[str, bytes]:
    photo = encode(Image.fromarray(skimage_data.chelsea()), quality=90)
    head, tail = photo[:-2], EOI
    com = segment(0xFE, b"hi")
    return {
        "photo": photo,
        "photo-progressive": encode(Image.fromarray(skimage_data.chelsea()), progressive=True),
        "photo-restart-every-block": encode(
            Image.fromarray(skimage_data.chelsea()), restart_marker_blocks=1
        ),
        "scans-at-limit": SOI + SCAN * MAX_JPEG_SCANS + EOI,
        "scans-over-limit": SOI + SCAN * (MAX_JPEG_SCANS + 1) + EOI,
        "segments-at-limit": SOI + com * (MAX_JPEG_SEGMENTS - 1) + SCAN + EOI,
        "segments-over-limit": SOI + com * MAX_JPEG_SEGMENTS + SCAN + EOI,
        "segments-after-scan-over-limit": head + com * MAX_JPEG_SEGMENTS + tail,
        "many-restarts-in-scan": SOI + SCAN + b"\x11\xff\xd3" * 5000 + EOI,
        "many-stuffed-ff-in-scan": SOI + SCAN + b"\xff\x00" * 5000 + EOI,
        "large-file": SOI + SCAN + b"\x00" * 600_000 + EOI,  # past the bound's size cap
        "large-file-over-limit": SOI + SCAN + b"\x00" * 600_000 + com * MAX_JPEG_SEGMENTS + EOI,
        "fill-bytes": SOI + b"\xff" * 3000 + com + b"\xff" * 3000 + SCAN + EOI,
        "ff-inside-app": SOI + segment(0xE5, b"\xff\xda" * 30000) + SCAN + EOI,
        # Where a length lands the walk on a stuffed zero or a restart marker, it counts it
        # (after a scan: the bound is taken where the walk first meets entropy-coded data):
        "stuffed-zero-segments-after-scan": SOI
        + SCAN
        + com
        + b"\xff\x00\x00\x02" * MAX_JPEG_SEGMENTS
        + EOI,
        "restart-segments-after-scan": SOI + SCAN + com + b"\xff\xd0" * MAX_JPEG_SEGMENTS + EOI,
        "stuffed-zero-segments": SOI + com + b"\xff\x00\x00\x02" * MAX_JPEG_SEGMENTS + EOI,
        "restart-segments": SOI + com + b"\xff\xd0" * MAX_JPEG_SEGMENTS + EOI,
        "restart-segments-at-limit": SOI + com + b"\xff\xd0" * (MAX_JPEG_SEGMENTS - 1) + EOI,
        "scan-starting-with-stuffed-ff": SOI + segment(0xDA, b"\x00") + b"\xff\x00" + b"\0" * 9,
    }


STRUCTURE = structure_cases()


@pytest.mark.parametrize("name", list(STRUCTURE))
def test_structure_check_matches_the_walk(name: str) -> None:
    data = STRUCTURE[name]
    assert verdict(check_structure, data) == verdict(walk_reference, data)


def test_structure_cases_cover_both_verdicts() -> None:
    verdicts = {name: verdict(walk_reference, data) for name, data in STRUCTURE.items()}
    assert verdicts["photo"] == verdicts["segments-at-limit"] == "accepted"
    assert verdicts["many-restarts-in-scan"] == verdicts["restart-segments-at-limit"] == "accepted"
    assert "scans" in verdicts["scans-over-limit"]
    assert "marker segments" in verdicts["stuffed-zero-segments"]
    assert "marker segments" in verdicts["restart-segments"]


def test_bound_counts_what_the_walk_counts_at_a_segment() -> None:
    """A bound that left out stuffed zeros and restart markers (they are no segment inside a
    scan) would wave these files through: the walk counts them where a length lands on them."""
    for name in ("stuffed-zero-segments-after-scan", "restart-segments-after-scan"):
        data = STRUCTURE[name]
        restarts = sum(data.count(bytes([0xFF, m])) for m in range(0xD0, 0xD8))
        naive = data.count(b"\xff") - data.count(b"\xff\x00") - restarts
        assert naive <= MAX_JPEG_SEGMENTS
        assert "marker segments" in verdict(check_structure, data)


def random_jpeg(rng: random.Random) -> bytes:
    """Headers, scans, restart markers, stuffed and fill bytes in random order and number."""
    parts = [SOI]
    for _ in range(rng.randrange(40)):
        kind = rng.randrange(7)
        if kind == 0:
            parts.append(
                segment(rng.choice([0xE0, 0xE1, 0xFE, 0xC4]), rng.randbytes(rng.randrange(8)))
            )
        elif kind == 1:
            parts.append(SCAN)
        elif kind == 2:
            parts.append(bytes([0xFF, rng.randrange(0xD0, 0xD8)]) * rng.randrange(1, 6))
        elif kind == 3:
            parts.append(b"\xff\x00" * rng.randrange(4))
        elif kind == 4:
            parts.append(b"\xff" * rng.randrange(1, 4))
        elif kind == 5:
            parts.append(bytes(rng.choice([0x00, 0x12, 0xFF]) for _ in range(rng.randrange(6))))
        else:
            parts.append(b"\xff\x00\x00\x02" * rng.randrange(1, 6))
    if rng.random() < 0.7:
        parts.append(EOI)
    return b"".join(parts)


@pytest.mark.parametrize("chunk", [1 << 18, 3])
def test_structure_check_matches_the_walk_on_random_files(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Limits lowered so that small random files sit on both sides of them; and chunks so
    small that pairs straddle them."""
    monkeypatch.setattr(preprocess, "_BOUND_CHUNK", chunk)
    monkeypatch.setattr(preprocess, "MAX_JPEG_SEGMENTS", 12)
    monkeypatch.setattr(preprocess, "MAX_JPEG_SCANS", 3)
    rng = random.Random(23)
    seen = set()
    for _ in range(3000):
        data = random_jpeg(rng)
        expected = verdict(walk_reference, data)
        assert verdict(check_structure, data) == expected, data
        seen.add(expected.split(" ")[-1])
    assert seen == {"accepted", "segments", "scans"}


# ---- the header parser -----------------------------------------------------------------------


@functools.cache
def photos() -> dict[str, Image.Image]:
    folder = Path(skimage_data.__file__).parent
    out: dict[str, Image.Image] = {}
    for name in ("chelsea.png", "astronaut.png", "coffee.png", "camera.png", "rocket.jpg"):
        with Image.open(folder / name) as img:
            out[name.split(".")[0]] = img.copy()
    with Image.open(folder / "motorcycle_left.png") as img:
        out["motorcycle_left"] = img.copy()
    out["chelsea-640x480"] = out["chelsea"].resize((640, 480))
    out["odd-641x479"] = out["coffee"].resize((641, 479))
    out["tall-333x1001"] = out["astronaut"].resize((333, 1001))
    out["tiny-1x1"] = out["chelsea"].resize((1, 1))
    out["tiny-7x5"] = out["chelsea"].resize((7, 5))
    return out


def header_cases() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, img in photos().items():
        out[name] = encode(img, quality=90)
        out[f"{name}-progressive"] = encode(img, quality=85, progressive=True)
    chelsea = photos()["chelsea"]
    for subsampling, label in ((0, "444"), (1, "422"), (2, "420")):
        out[f"chelsea-{label}"] = encode(chelsea, subsampling=subsampling)
        out[f"chelsea-{label}-progressive"] = encode(
            chelsea, subsampling=subsampling, progressive=True
        )
    out["chelsea-restart-blocks"] = encode(chelsea, restart_marker_blocks=4)
    out["chelsea-restart-rows"] = encode(chelsea, restart_marker_rows=1, progressive=True)
    out["chelsea-keep-rgb"] = encode(chelsea, keep_rgb=True)  # Adobe APP14, transform 0
    out["chelsea-grey"] = encode(chelsea.convert("L"))
    out["chelsea-cmyk"] = encode(chelsea.convert("CMYK"))
    out["chelsea-comment"] = encode(chelsea, comment=b"\xff\xd8 a comment")
    for o in range(1, 9):
        out[f"chelsea-exif-{o}"] = with_orientation(chelsea, o)
        out[f"camera-exif-{o}-progressive"] = with_orientation(
            photos()["camera"], o, progressive=True
        )
    big_endian = Image.Exif()
    big_endian[ExifTags.Base.Orientation] = 6
    big_endian[ExifTags.Base.Make] = "a camera maker with a long name"
    big_endian.endian = ">"  # Pillow writes little-endian unless told
    out["chelsea-exif-big-endian"] = encode(chelsea, exif=big_endian.tobytes())
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'
    out["chelsea-xmp-8"] = insert(
        out["chelsea"], segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0" + xmp)
    )
    out["chelsea-icc"] = encode(chelsea, icc_profile=bytes(range(256)) * 300)  # 2 segments
    iptc = b"8BIM\x04\x04\x00\x00\x00\x00\x00\x05\x1c\x02\x00\x00\x02\x00"
    photoshop = segment(0xED, b"Photoshop 3.0\x00" + iptc + b"8BIM\x03\xed\x00\x00" + b"\0" * 4)
    out["chelsea-photoshop"] = insert(out["chelsea"], photoshop)
    out["chelsea-fill-bytes"] = out["chelsea"][:2] + b"\xff\xff" + out["chelsea"][2:]
    return out


HEADERS = header_cases()


def pillow_view(data: bytes, target: int) -> dict[str, object]:
    img = Image.open(io.BytesIO(data))
    full = img.size
    view = {
        "size": full,
        "mode": img.mode,
        "progressive": bool(img.info.get("progressive")),
        "layers": tuple(img.layer),  # type: ignore[attr-defined]
        "orientation": img.getexif().get(ExifTags.Base.Orientation, 1),
    }
    img.draft(None, (target, target))
    return {**view, "drafted": img.size}


@pytest.mark.parametrize("name", list(HEADERS))
@pytest.mark.parametrize("target", [448, 224, 100, 1])
def test_header_matches_pillow(name: str, target: int) -> None:
    data = HEADERS[name]
    header = read_header(data)
    if name.endswith("cmyk"):
        assert header is None
        return
    assert header is not None
    parsed = {
        "size": header.size,
        "mode": header.mode,
        "progressive": header.progressive,
        "layers": header.layers,
        "orientation": header.orientation,
        "drafted": drafted_size(header.size, target),
    }
    assert parsed == pillow_view(data, target)


def outcome(decoder: ImageDecoder, data: bytes) -> tuple[str, bytes]:
    """The crop's shape and bytes, or the error's class, code and message; and the warnings
    on the way (Pillow warns of odd EXIF or MPO data)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            crop = decoder(data)
        except ClipserveError as e:
            answer, pixels = f"{type(e).__name__} {e.code}: {e}", b""
        else:
            answer, pixels = f"{crop.shape}", crop.tobytes()
    said = sorted(f"{w.category.__name__}: {w.message}" for w in caught)
    return " | ".join([answer, *said]), pixels


def decoders(
    max_pixels: int = 10**8, max_bytes: int = preprocess.DEFAULT_MAX_DECODE_BYTES
) -> tuple[ImageDecoder, ImageDecoder]:
    """The decoder with the header parser, and one that opens every file with Pillow."""
    if fast_jpeg() is None:
        pytest.skip("the fast JPEG path (simplejpeg, vectorised torch) is not installed")
    return (
        ImageDecoder(SPEC, max_pixels, max_bytes=max_bytes),
        ImageDecoder(SPEC, max_pixels, max_bytes=max_bytes, read_headers=False),
    )


@pytest.mark.parametrize("name", list(HEADERS))
def test_crops_are_identical_with_and_without_the_parser(name: str) -> None:
    parsed, pillow = decoders()
    expected = outcome(pillow, HEADERS[name])
    assert expected[0].startswith("(224, 224, 3)")
    assert outcome(parsed, HEADERS[name]) == expected


@pytest.mark.parametrize("name", ["chelsea", "chelsea-progressive", "camera-exif-6-progressive"])
def test_decode_bytes_limit_is_the_same_to_the_byte(name: str) -> None:
    data = HEADERS[name]
    img = Image.open(io.BytesIO(data))
    full = img.size
    img.draft(None, (2 * 224, 2 * 224))
    needed = preprocess.decode_bytes(img, full)
    if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        needed += preprocess.raster_bytes(img)
    for limit, accepted in ((needed, True), (needed - 1, False)):
        parsed, pillow = decoders(max_bytes=limit)
        expected = outcome(pillow, data)
        assert expected[0].startswith("(224") == accepted
        assert outcome(parsed, data) == expected


def broken_cases() -> dict[str, bytes]:
    photo = HEADERS["chelsea-exif-6"]
    sof = photo.index(b"\xff\xc0")
    app1 = photo.index(b"\xff\xe1")
    exif_tiff = app1 + 10
    zero_components = b"\x08\x01\xe0\x02\x80\x00"
    return {
        "cut-inside-sof": photo[: sof + 9],
        "cut-inside-app1": photo[: app1 + 30],
        "zero-length-segment": insert(photo, b"\xff\xe3\x00\x00"),
        "length-one-segment": insert(photo, b"\xff\xe3\x00\x01"),
        "sof-zero-components": photo[:sof] + segment(0xC0, zero_components) + photo[sof + 19 :],
        "sof-zero-height": photo[: sof + 5] + b"\x00\x00" + photo[sof + 7 :],
        "absurd-dimensions": photo[: sof + 5] + b"\xff\xff\xff\xff" + photo[sof + 9 :],
        "aspect-over-limit": photo[: sof + 5] + b"\x00\x01\x01\x00" + photo[sof + 9 :],
        "twelve-bit": photo[: sof + 4] + b"\x0c" + photo[sof + 5 :],
        "sampling-zero": photo[: sof + 11] + b"\x00" + photo[sof + 12 :],
        "second-sof": insert(photo, photo[sof : sof + 19]),
        "extended-sof1": photo[:sof] + b"\xff\xc1" + photo[sof + 2 :],
        "lossless-sof3": photo[:sof] + b"\xff\xc3" + photo[sof + 2 :],
        "junk-between-markers": insert(photo, segment(0xFE, b"x"), b"\x00"),
        "short-dqt": insert(photo, segment(0xDB, b"\x00" * 30)),
        "short-jfif": insert(photo, segment(0xE0, b"JFIF\x00")),
        "short-icc": insert(photo, segment(0xE2, b"ICC_PROFILE\x00\x01")),
        "short-adobe": insert(photo, segment(0xEE, b"Adobe")),
        "adobe-ycck": insert(photo, segment(0xEE, b"Adobe\x00\x64\x00\x00\x00\x00\x02")),
        "photoshop-cut-name": insert(photo, segment(0xED, b"Photoshop 3.0\x008BIM\x04\x04")),
        "photoshop-cut-size": insert(
            photo, segment(0xED, b"Photoshop 3.0\x008BIM\x04\x04\x00\x00\x00")
        ),
        "mpf": insert(photo, segment(0xE2, b"MPF\x00MM\x00*\x00\x00\x00\x08\x00\x00")),
        "second-exif": insert(photo, segment(0xE1, b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x00\x00")),
        "exif-bad-tiff-header": photo[:exif_tiff] + b"XX" + photo[exif_tiff + 2 :],
        "exif-ifd-past-end": photo[: exif_tiff + 4] + b"\xff\x00\x00\x00" + photo[exif_tiff + 8 :],
        "exif-orientation-9": with_orientation(photos()["chelsea"], 9),
        "exif-orientation-0": with_orientation(photos()["chelsea"], 0),
        "xmp-orientation-0": insert(
            HEADERS["chelsea"],
            segment(0xE1, b'http://ns.adobe.com/xap/1.0/\0<a tiff:Orientation="0"/>'),
        ),
        "no-sos": photo[: photo.index(SOS)],
        "cut-inside-sos": photo[: photo.index(SOS) + 6],
        "cut-in-scan": photo[: photo.index(SOS) + 500],
        "dnl": insert(photo, segment(0xDC, b"\x01\xe0")),
        "tem": insert(photo, b"\xff\x01"),
    }


BROKEN = broken_cases()


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_headers_give_the_same_answer(name: str) -> None:
    parsed, pillow = decoders(max_pixels=40_000_000)
    assert outcome(parsed, BROKEN[name]) == outcome(pillow, BROKEN[name])


@pytest.mark.parametrize(
    "name",
    [
        name
        for name in BROKEN
        if name
        not in ("cut-in-scan", "aspect-over-limit", "absurd-dimensions", "photoshop-cut-size")
    ],
)
def test_parser_leaves_odd_headers_to_pillow(name: str) -> None:
    assert read_header(BROKEN[name]) is None


def test_broken_cases_reach_each_kind_of_refusal() -> None:
    _, pillow = decoders(max_pixels=40_000_000)
    answers = " ".join(outcome(pillow, data)[0] for data in BROKEN.values())
    for words in ("unreadable image header", "not a JPEG", "ImageTooLarge", "aspect ratio"):
        assert words in answers


def test_images_past_pillows_bomb_limit_go_to_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    parsed, pillow = decoders()
    expected = outcome(pillow, HEADERS["chelsea"])
    assert "safety limit" in expected[0]
    assert outcome(parsed, HEADERS["chelsea"]) == expected


def test_tiff_unit_sizes_are_pillows() -> None:
    dispatch = TiffImagePlugin.ImageFileDirectory_v2._load_dispatch
    assert {kind: size for kind, (size, _) in dispatch.items()} == TIFF_UNIT_SIZES


def test_parsed_and_pillow_crops_differ_where_orientation_does() -> None:
    """The equality tests above can fail: a wrong orientation changes the crop."""
    parsed, _ = decoders()
    upright = outcome(parsed, HEADERS["chelsea-exif-1"])[1]
    rotated = outcome(parsed, HEADERS["chelsea-exif-6"])[1]
    assert not np.array_equal(np.frombuffer(upright, np.uint8), np.frombuffer(rotated, np.uint8))
