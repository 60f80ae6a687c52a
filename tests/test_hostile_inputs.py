"""Inputs built to be small on the wire and large in memory or time: each is refused with a 4xx
(or served within bounded memory), never a 500. Pure codec/decoder tests first, then HTTP."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
import zlib
from collections.abc import Callable

import httpx
import msgpack
import numpy as np
import pytest
from PIL import Image

from clipserve.errors import (
    ClipserveError,
    ImageTooLarge,
    InvalidBody,
    InvalidImage,
    InvalidTensor,
    TooManyItems,
    TooManyTexts,
)
from clipserve.inference.preprocess import MAX_JPEG_SCANS, ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import encode, synthetic_image
from clipserve.protocol.multipart import parse_files
from clipserve.protocol.requests import parse_body
from clipserve.protocol.tensors import parse_shape, parse_tensor
from clipserve.protocol.text import parse_texts
from tests.helpers import PNG, Serve, png_chunk, with_orientation

SPEC = PreprocessSpec((224, 224), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
SIZE = (224, 224)
MSGPACK = "application/msgpack"


# ---- crafted files: kilobytes on the wire ------------------------------------------------------


def solid_png(
    width: int, height: int, colour_type: int = 2, bit_depth: int = 8, extra: bytes = b""
) -> bytes:
    """A valid all-zero PNG of any size, compressed ~1000:1 (64 x 625,000 RGB is 117 KB)."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour_type]
    row = b"\x00" * (1 + width * channels * bit_depth // 8)
    z, rows, per = zlib.compressobj(9), [], max(1, (1 << 20) // len(row))
    for done in range(0, height, per):
        rows.append(z.compress(row * min(per, height - done)))
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + extra
        + png_chunk(b"IDAT", b"".join(rows) + z.flush())
        + png_chunk(b"IEND", b"")
    )


def progressive_jpeg_with_scans(extra_scans: int) -> bytes:
    """A progressive JPEG whose last (tiny) scan is repeated: libjpeg re-reads every block per
    scan, so 1,000 extra scans of 31 bytes cost 18 s at 4000 x 4000."""
    data = encode(Image.new("RGB", (512, 512), (90, 120, 200)), "JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    return data[:-2] + data[last:-2] * extra_scans + b"\xff\xd9"


def nested_msgpack(n: int) -> bytes:
    """n empty arrays in one array: n bytes on the wire, n Python lists once unpacked."""
    return msgpack.packb({"images": [[] for _ in range(n)]})


def decode(data: bytes, max_bytes: int = 256 << 20, max_aspect: float = 200.0) -> np.ndarray:
    return ImageDecoder(SPEC, 40_000_000, max_bytes=max_bytes, max_aspect=max_aspect)(data)


def msgpack_tree(width: int, depth: int) -> bytes:
    """Arrays of `width` arrays, `depth` deep: each within any length limit, width**depth in all."""
    tree: list[object] = []
    for _ in range(depth):
        tree = [tree] * width
    return msgpack.packb({"images": tree})


# ---- images: shape, decoded bytes, structure ---------------------------------------------------


@pytest.mark.parametrize(("width", "height"), [(1, 39_999_999), (64, 625_000), (625_000, 64)])
def test_extreme_aspect_ratio_is_refused_from_the_header(width: int, height: int) -> None:
    data = solid_png(width, height)
    assert len(data) < 200_000
    t0 = time.perf_counter()
    with pytest.raises(InvalidImage, match=r"aspect ratio over 200:1 \(--max-image-aspect\)"):
        decode(data)
    assert time.perf_counter() - t0 < 0.5  # refused before decoding


def test_tall_image_within_the_aspect_limit_resizes_only_the_crop() -> None:
    # 20 x 3000 (150:1): open_clip's resize alone would be 224 x 33,600 pixels.
    data = solid_png(20, 3000, colour_type=0)
    out = decode(data)
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8 and out.max() == 0


def test_pointer_per_row_counts_toward_decoded_bytes() -> None:
    # With the aspect limit lifted, 1 x 39,999,999 would hold 160 MB of pixels and 320 MB of
    # row pointers: refused from the header by bytes, not by pixels.
    with pytest.raises(ImageTooLarge, match=r"MiB; the limit is 256 MiB \(--max-decode-bytes\)"):
        decode(solid_png(1, 39_999_999), max_aspect=1e12)


@pytest.mark.parametrize(
    ("colour_type", "bit_depth", "mode", "pixels_at_16_mib"),
    [
        (0, 8, "L", 14_000_000),
        (0, 16, "I;16", 7_000_000),
        (2, 8, "RGB", 3_500_000),
        (6, 8, "RGBA", 1_800_000),
    ],
)
def test_decoded_bytes_depend_on_the_mode(
    colour_type: int, bit_depth: int, mode: str, pixels_at_16_mib: int
) -> None:
    """Under a 16 MiB budget, L fits 14 M pixels, I;16 7 M, RGB 3.5 M and RGBA (premultiplied
    copy for the resize) 1.8 M; twice as many are refused, naming mode and flag."""
    side = int(pixels_at_16_mib**0.5)
    ok = decode(solid_png(side, side, colour_type, bit_depth), max_bytes=16 << 20)
    assert ok.shape == (224, 224, 3)
    big = int(side * 1.45)
    with pytest.raises(ImageTooLarge, match=rf"\({mode}\).*--max-decode-bytes"):
        decode(solid_png(big, big, colour_type, bit_depth), max_bytes=16 << 20)


def test_webp_counts_its_decoder_copies() -> None:
    # libwebp's canvas, the frame bytes and Pillow's raster: 4 x 4 bytes a pixel.
    data = encode(Image.new("RGB", (1200, 1200), (10, 20, 30)), "WEBP", lossless=True)
    assert decode(data, max_bytes=24 << 20).shape == (224, 224, 3)  # 23 MB estimated
    with pytest.raises(ImageTooLarge, match=r"WEBP image \(RGB\)"):
        decode(data, max_bytes=16 << 20)


def test_progressive_jpeg_counts_its_coefficients_despite_the_draft() -> None:
    img = Image.new("RGB", (2000, 2000), (1, 2, 3))
    baseline, progressive = encode(img, "JPEG"), encode(img, "JPEG", progressive=True)
    assert decode(baseline, max_bytes=4 << 20).shape == (224, 224, 3)  # drafted to 250 x 250
    with pytest.raises(ImageTooLarge, match="JPEG"):  # 2000 x 2000 x 3 bytes of coefficients
        decode(progressive, max_bytes=4 << 20)
    assert decode(progressive, max_bytes=16 << 20).shape == (224, 224, 3)


def test_exif_rotation_copy_counts() -> None:
    data = with_orientation(Image.new("RGB", (1500, 1000), (5, 5, 5)), 6, "PNG")
    with pytest.raises(ImageTooLarge, match="EXIF-rotated"):
        decode(data, max_bytes=8 << 20)  # 6 MB of pixels fit; their rotated copy does not
    assert decode(data, max_bytes=12 << 20).shape == (224, 224, 3)


def test_jpeg_scan_bomb_is_refused_before_decoding() -> None:
    normal = encode(synthetic_image(640, 480), "JPEG", progressive=True)
    assert decode(normal).shape == (224, 224, 3)  # libjpeg's ten scans
    bomb = progressive_jpeg_with_scans(MAX_JPEG_SCANS)
    t0 = time.perf_counter()
    with pytest.raises(InvalidImage, match=f"more than {MAX_JPEG_SCANS} scans"):
        decode(bomb)
    assert time.perf_counter() - t0 < 1.0  # seconds before the fix; generous for slow CI


def test_jpeg_segment_flood_is_refused_before_pillow_walks_it() -> None:
    data = encode(Image.new("RGB", (64, 64)), "JPEG")
    flood = data[:2] + b"\xff\xe5\x00\x02" * 1_000_000 + data[2:]  # 4 MB: 2.6 s in Pillow
    t0 = time.perf_counter()
    with pytest.raises(InvalidImage, match="marker segments"):
        decode(flood)
    assert time.perf_counter() - t0 < 1.0  # seconds before the fix; generous for slow CI


@pytest.mark.parametrize("kind", [b"quUx", b"IDAT"])
def test_png_chunk_flood_is_refused(kind: bytes) -> None:
    flood = png_chunk(kind, b"") * 100_000  # 1.2 MB; 1,000,000 such chunks took Pillow 7-13 s
    t0 = time.perf_counter()
    with pytest.raises(InvalidImage, match="more than 16384 chunks"):
        decode(solid_png(64, 64, extra=flood))
    assert time.perf_counter() - t0 < 1.0  # seconds before the fix; generous for slow CI


def test_ztxt_bomb_is_refused() -> None:
    # Each 1 KB zTXt chunk inflates to Pillow's 1 MiB cap: 64 of them held 66 MB.
    text = zlib.compress(b"a" * (1 << 20), 9)
    chunks = b"".join(png_chunk(b"zTXt", b"k%d\x00\x00" % i + text) for i in range(64))
    with pytest.raises(InvalidImage, match="text chunks"):
        decode(solid_png(64, 64, extra=chunks))
    few = b"".join(png_chunk(b"zTXt", b"k%d\x00\x00" % i + text) for i in range(2))
    assert decode(solid_png(64, 64, extra=few)).shape == (224, 224, 3)


def _exif(entries: int, orientation: int = 1) -> bytes:
    """A little-endian EXIF block: Orientation, then `entries` filler SHORT tags."""
    tags = [(0x0112, orientation)] + [(0x1000 + i % 60000, 0) for i in range(entries)]
    ifd = struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", t, 3, 1, v) for t, v in tags)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_huge_exif_is_refused_before_python_parses_it(fmt: str) -> None:
    # 65,535 entries (786 KB) took Pillow 0.35 s of GIL-holding Python per image.
    img = Image.new("RGB", (64, 32), (9, 9, 9))
    with pytest.raises(InvalidImage, match=r"EXIF of \d+ bytes; at most 65535"):
        decode(encode(img, fmt, exif=_exif(65_534), lossless=True))
    rotated = decode(encode(img, fmt, exif=_exif(5000, orientation=6), lossless=True))
    assert rotated.shape == (224, 224, 3)  # 60 KB of EXIF is read, and applied


def test_webp_chunk_flood_is_refused() -> None:
    data = encode(Image.new("RGB", (64, 64)), "WEBP")
    flood = b"JUNK\x00\x00\x00\x00" * 20_000
    body = data[12:] + flood
    riff = b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body
    with pytest.raises(InvalidImage, match="more than 16384 chunks"):
        decode(riff)


@pytest.mark.parametrize(
    "data",
    [
        solid_png(64, 64)[:60],
        encode(synthetic_image(300, 200), "WEBP")[:200],
        b"\xff\xd8\xff\xe0\x00",
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR",
    ],
    ids=["png-cut", "webp-cut", "jpeg-header-cut", "png-ihdr-cut"],
)
def test_truncated_images_are_invalid_not_errors(data: bytes) -> None:
    with pytest.raises(InvalidImage):
        decode(data)


def test_animated_images_use_their_first_frame() -> None:
    frames = [Image.new("RGB", (64, 64), (200 * (i == 0), 0, 0)) for i in range(50)]
    for fmt in ("PNG", "WEBP"):
        buf = io.BytesIO()
        frames[0].save(
            buf, fmt, save_all=True, append_images=frames[1:], duration=10, lossless=True
        )
        assert decode(buf.getvalue())[0, 0].tolist() == [200, 0, 0], fmt


PEAK_SCRIPT = textwrap.dedent("""
    import resource, sys
    from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
    data = sys.stdin.buffer.read()
    spec = PreprocessSpec((224, 224), (0.5,) * 3, (0.5,) * 3)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = ImageDecoder(spec, 40_000_000, max_aspect=1e12)(data)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(out.shape, (after - before) // 1024)
""")


def test_tall_image_peak_memory_is_bounded_by_the_decoded_raster() -> None:
    """64 x 625,000 RGB (40 M pixels, 117 KB): open_clip's full resize took the process from
    2.2 to 4.7 GiB and 12 s here. Resizing only the crop's region holds the 153 MiB raster."""
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT],
        input=solid_png(64, 625_000),
        capture_output=True,
        check=True,
        timeout=120,
    )
    shape, peak_mib = result.stdout.decode().rsplit(" ", 1)
    assert shape == "(224, 224, 3)"
    assert int(peak_mib) < 400, f"peak grew by {peak_mib} MiB"


# ---- modes: every mode the formats yield is accepted at every size ------------------------------


def _i16_png(width: int, height: int) -> bytes:
    values = (np.arange(width * height, dtype=np.uint32) % 600).astype(np.uint16)
    return encode(Image.fromarray(values.reshape(height, width)), "PNG")


@pytest.mark.parametrize("size", [(64, 48), (300, 200), (2000, 2000), (3000, 500)])
@pytest.mark.parametrize(
    "make",
    [
        lambda w, h: _i16_png(w, h),
        lambda w, h: solid_png(w, h, 2, 16),
        lambda w, h: solid_png(w, h, 6, 16),
        lambda w, h: solid_png(w, h, 4, 16),
        lambda w, h: solid_png(w, h, 0, 8),
        lambda w, h: solid_png(w, h, 4, 8),
    ],
    ids=["I;16", "rgb16", "rgba16", "la16", "L", "LA"],
)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
def test_sixteen_bit_and_grey_pngs_are_accepted_at_every_size(
    make: Callable[[int, int], bytes], size: tuple[int, int], fast: bool
) -> None:
    out = ImageDecoder(SPEC, 40_000_000, fast=fast)(make(*size))
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8


# ---- tensors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [3e38, -3e38, 65505.0, -1e5])
def test_float_tensor_outside_float16_range_is_refused(value: float) -> None:
    array = np.zeros((1, 3, 224, 224), np.float32)
    array[0, 1, 2, 3] = value
    with pytest.raises(InvalidTensor, match=r"float16's range \(\|x\| <= 65504\)"):
        parse_tensor("float32", [1, 3, 224, 224], array.tobytes(), SIZE, 8)
    array[0, 1, 2, 3] = 65504.0  # float16's largest finite value is still accepted
    assert parse_tensor("float32", [1, 3, 224, 224], array.tobytes(), SIZE, 8).shape[0] == 1


@pytest.mark.parametrize("raw", ["1," * 40_000, "9" * 5000, " " * 100])
def test_absurd_shape_headers_are_refused(raw: str) -> None:
    with pytest.raises(InvalidTensor):
        parse_shape(raw)


# ---- structured bodies: value budgets before objects are built ----------------------------------


def _peak_python_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    with contextlib.suppress(ClipserveError):
        fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    ("body", "media"),
    [
        (nested_msgpack(2_000_000), MSGPACK),
        (msgpack_tree(16, 5), MSGPACK),
        (msgpack.packb({"images": [None] * 2_000_000}), MSGPACK),
        (b"\xdd\x7f\xff\xff\xff" + b"\xc0" * 100, MSGPACK),  # declares 2^31 - 1 elements
        (b'{"images": [' + b"[]," * 2_000_000 + b"[]]}", "application/json"),
        (b'{"images": [' + b"{}," * 2_000_000 + b"{}]}", "application/json"),
    ],
    ids=[
        "msgpack-empty-arrays",
        "msgpack-tree",
        "msgpack-nils",
        "msgpack-declared-length",
        "json-arrays",
        "json-objects",
    ],
)
def test_value_bombs_are_refused_before_they_are_built(body: bytes, media: str) -> None:
    with pytest.raises(TooManyItems, match=r"more than 96 values.*--max-items-per-request"):
        parse_body(media, {}, body, SIZE, 64)
    # Without the budget, 2 M empty lists are ~130 MB of Python objects.
    assert _peak_python_bytes(lambda: parse_body(media, {}, body, SIZE, 64)) < 20 << 20


def test_value_budget_still_admits_full_requests_with_escapes() -> None:
    # PHP's json_encode writes "/" as "\/"; base64 is full of slashes.
    item = base64.b64encode(b"\xff" * 30).decode().replace("/", "\\/")
    body = ('{"images": [' + ",".join(f'"{item}"' for _ in range(64)) + "]}").encode()
    payload = parse_body("application/json", {}, body, SIZE, 64)
    assert len(payload) == 64 and payload.images[0] == b"\xff" * 30
    texts = ['a "quoted", [bracketed]: {text}\\'] * 64
    doc = json.dumps({"texts": texts}).encode()
    assert parse_texts("application/json", doc, 64, 1000) == texts
    assert parse_texts(MSGPACK, msgpack.packb({"texts": texts}), 64, 1000) == texts


@pytest.mark.parametrize(
    "body",
    [
        b'{"texts": [' + b"[]," * 1_000_000 + b"[]]}",
        b"[" + b" " * 5_000_000 + b"]",
        b'{"texts": ["' + b"a" * 5_000_000,
    ],
    ids=["arrays", "whitespace", "unterminated"],
)
def test_text_bodies_are_counted_too(body: bytes) -> None:
    t0 = time.perf_counter()
    with pytest.raises((TooManyTexts, InvalidBody)):
        parse_texts("application/json", body, 64, 1000)
    assert time.perf_counter() - t0 < 1.0


def test_msgpack_text_bodies_are_counted_too() -> None:
    with pytest.raises(TooManyTexts, match="more than 96 values"):
        parse_texts(MSGPACK, msgpack.packb({"texts": [[] for _ in range(100_000)]}), 64, 1000)


def test_msgpack_depth_and_ext_types_are_invalid_body() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises((InvalidBody, TooManyItems)):
        parse_body(MSGPACK, {}, deep, SIZE, 64)
    ext = msgpack.packb({"images": [msgpack.ExtType(5, b"\x89PNG")]})
    with pytest.raises(InvalidBody, match="item 0: images must be msgpack bin, not ExtType"):
        parse_body(MSGPACK, {}, ext, SIZE, 64)


# ---- multipart ---------------------------------------------------------------------------------


def _part(headers: list[bytes], boundary: bytes = b"b") -> bytes:
    return (
        b"--"
        + boundary
        + b"\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"\r\ndata\r\n--"
        + boundary
        + b"--\r\n"
    )


DISPOSITION = b'Content-Disposition: form-data; name="image"; filename="a.png"'


@pytest.mark.parametrize("length", [71, 257, 900])
def test_long_multipart_boundary_is_invalid_body(length: int) -> None:
    boundary = b"x" * length
    with pytest.raises(InvalidBody, match=f"boundary of {length} characters; RFC 2046"):
        parse_files(
            f"multipart/form-data; boundary={boundary.decode()}", _part([DISPOSITION], boundary), 8
        )


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ([DISPOSITION] + [b"X-%d: 1" % i for i in range(100)], "header count"),
        ([DISPOSITION, b"X-Big: " + b"a" * 100_000], "header size"),
    ],
    ids=["many-headers", "huge-header"],
)
def test_part_headers_are_bounded(headers: list[bytes], fragment: str) -> None:
    with pytest.raises(InvalidBody, match=fragment):
        parse_files("multipart/form-data; boundary=b", _part(headers), 8)


def test_content_type_parameters_are_bounded() -> None:
    with pytest.raises(InvalidBody, match="Content-Type of"):
        parse_files("multipart/form-data; boundary=b" + "; a=b" * 10_000, _part([DISPOSITION]), 8)


def test_a_body_of_near_delimiters_is_refused_before_it_is_parsed() -> None:
    # Each partial delimiter is walked in Python: 30 MiB of them took ~4 s (plain bytes 0.19).
    def holding(data: bytes) -> bytes:
        return _part([DISPOSITION]).replace(b"\r\ndata\r\n", b"\r\n" + data + b"\r\n")

    with pytest.raises(InvalidBody, match="delimiter-like"):  # counted, never parsed
        parse_files("multipart/form-data; boundary=b", holding(b"\r\n--bx" * 100_000), 8)
    few = b"\r\n--bx" * 60  # an image's bytes may hold a few
    assert parse_files("multipart/form-data; boundary=b", holding(few), 8) == [few]


@pytest.mark.parametrize("cut", [2, 4, 9])
def test_a_multipart_body_without_its_closing_boundary_is_refused(cut: int) -> None:
    body = _part([DISPOSITION])
    assert parse_files("multipart/form-data; boundary=b", body, 8) == [b"data"]
    with pytest.raises(InvalidBody, match="closing boundary"):
        parse_files("multipart/form-data; boundary=b", body[: -2 - cut], 8)


# ---- over HTTP: the status and error code a client sees ---------------------------------------


def test_hostile_inputs_over_http(serve: Serve) -> None:
    server = serve(max_items_per_request=8, max_batch_size=8)
    tall = solid_png(1, 39_999_999)
    f32 = np.zeros((1, 3, 224, 224), np.float32)
    f32[0, 0, 0, 0] = 3e38
    tensor = msgpack.packb(
        {"tensor": {"dtype": "float32", "shape": [1, 3, 224, 224], "data": f32.tobytes()}}
    )
    boundary = "z" * 300
    cases = [
        ("tall", tall, PNG, 400, "invalid_image", "--max-image-aspect"),
        ("i16", _i16_png(2000, 2000), PNG, 200, None, None),
        ("float-range", tensor, {"Content-Type": MSGPACK}, 400, "invalid_tensor", "65504"),
        (
            "boundary",
            _part([DISPOSITION], boundary.encode()),
            {"Content-Type": f"multipart/form-data; boundary={boundary}"},
            400,
            "invalid_body",
            "RFC 2046",
        ),
        (
            "msgpack-bomb",
            nested_msgpack(1_000_000),
            {"Content-Type": MSGPACK},
            413,
            "too_many_items",
            "values",
        ),
        (
            "json-bomb",
            b'{"images": [' + b"[]," * 1_000_000 + b"[]]}",
            {"Content-Type": "application/json"},
            413,
            "too_many_items",
            "values",
        ),
        (
            "scan-bomb",
            progressive_jpeg_with_scans(200),
            {"Content-Type": "image/jpeg"},
            400,
            "invalid_image",
            "scans",
        ),
    ]
    for name, body, headers, status, code, fragment in cases:
        r = httpx.post(server.url + "/embed", content=body, headers=headers, timeout=60)
        assert r.status_code == status, (name, r.text)
        if code is not None:
            error = r.json()["error"]
            assert error["code"] == code and fragment in error["message"], (name, error)
    texts = b'{"texts": [' + b"{}," * 1_000_000 + b"{}]}"
    r = httpx.post(
        server.url + "/embed/text",
        content=texts,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_texts", r.text


def test_image_limit_flags_reach_the_decoder(serve: Serve) -> None:
    server = serve(max_image_aspect=2, max_decode_bytes=1 << 20)

    def post(data: bytes) -> httpx.Response:
        return httpx.post(server.url + "/embed", content=data, headers=PNG, timeout=60)

    assert post(solid_png(224, 224)).status_code == 200  # 0.2 MB decoded
    wide = post(solid_png(300, 100)).json()["error"]
    assert wide["code"] == "invalid_image" and "over 2:1 (--max-image-aspect)" in wide["message"]
    big = post(solid_png(600, 600))  # 1.4 MB decoded
    assert big.status_code == 413, big.text
    assert "the limit is 1 MiB (--max-decode-bytes)" in big.json()["error"]["message"]
