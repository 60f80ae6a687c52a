"""A corpus of corrupt JPEGs, made at test time from a real photograph (scikit-image's
astronaut): each breaks one part of the file that nvJPEG's hardware path does not check (it
reads headers, not the entropy-coded data) while the header still opens, so admission's header
walk passes it and only a check of the data can refuse it.

    python -m tests.inference.corrupt_jpeg DIR     writes the corpus as DIR/<name>.jpg
"""

from __future__ import annotations

import io
import sys
from functools import cache
from pathlib import Path

from PIL import Image

SOS, DQT, SOF0, EOI = b"\xff\xda", b"\xff\xdb", b"\xff\xc0", b"\xff\xd9"


@cache
def photo(restart_rows: int = 0) -> bytes:
    """The photograph as a baseline 4:2:0 JPEG (restart markers every `restart_rows` MCU rows)."""
    out = io.BytesIO()
    params = {"restart_marker_rows": restart_rows} if restart_rows else {}
    try:
        import skimage.data

        image = Image.fromarray(skimage.data.astronaut())  # type: ignore[no-untyped-call]
    except ImportError:  # the GPU hosts' image (bench/gpu_check): a synthetic one
        from clipserve.loadgen.images import synthetic_image

        image = synthetic_image(512, 512, 7)
    image.save(out, "JPEG", quality=90, **params)
    return out.getvalue()


def scan_start(data: bytes) -> int:
    """Offset of the first byte of entropy-coded data (after the SOS segment)."""
    sos = data.index(SOS)
    return sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")


def _with_length(data: bytes, marker: bytes, delta: int) -> bytes:
    at = data.index(marker)
    length = int.from_bytes(data[at + 2 : at + 4], "big") + delta
    return data[: at + 2] + length.to_bytes(2, "big") + data[at + 4 :]


def truncated_scan() -> bytes:
    """Half the scan, then EOI: the file still ends as a JPEG should."""
    data = photo()
    start = scan_start(data)
    return data[: start + (len(data) - start) // 2] + EOI


def bad_huffman_code() -> bytes:
    """64 one bits mid-scan (stuffed 0xFF bytes). Codes are at most 16 bits and no code is all
    ones; a code's extra bits (at most 11) may absorb some, but the next code starts within
    the run and cannot end in it."""
    data = photo()
    at = (scan_start(data) + len(data)) // 2
    return data[:at] + b"\xff\x00" * 8 + data[at + 16 :]


def zeroed_scan() -> bytes:
    """Four kilobytes of zeros in place of scan data: decodable codes, then a premature end."""
    data = photo()
    at = scan_start(data) + 1000
    return data[:at] + b"\x00" * 4096 + data[at + 4096 :]


def stray_marker_in_scan() -> bytes:
    """A DHT marker in the middle of the entropy-coded data."""
    data = photo()
    at = (scan_start(data) + len(data)) // 2
    return data[:at] + b"\xff\xc4" + data[at + 2 :]


def restart_out_of_order() -> bytes:
    """The first restart marker renumbered: RST0 expected, RST5 found."""
    data = photo(restart_rows=4)
    at = data.index(b"\xff\xd0", scan_start(data))
    return data[:at] + b"\xff\xd5" + data[at + 2 :]


def sos_length_too_long() -> bytes:
    """The SOS segment claims two bytes of the scan as its own."""
    return _with_length(photo(), SOS, 2)


def dqt_length_too_short() -> bytes:
    """The quantisation table segment one byte short: the next marker is misread."""
    return _with_length(photo(), DQT, -1)


def sof_length_too_long() -> bytes:
    """The frame header claims one byte more than its components take."""
    return _with_length(photo(), SOF0, 1)


CORPUS = {
    f.__name__: f
    for f in (
        truncated_scan,
        bad_huffman_code,
        zeroed_scan,
        stray_marker_in_scan,
        restart_out_of_order,
        sos_length_too_long,
        dqt_length_too_short,
        sof_length_too_long,
    )
}


def corpus() -> dict[str, bytes]:
    return {name: make() for name, make in CORPUS.items()}


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    for name, data in corpus().items():
        (target / f"{name}.jpg").write_bytes(data)
