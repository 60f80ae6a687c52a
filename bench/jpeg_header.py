"""Issue 23 (JPEG target): the header work of a served JPEG before any pixel is decoded, before
and after the two changes of this round, on the 640x480 q90 chelsea (scikit-image):

  structure   check_structure: the full marker walk (its counting bound switched off) against
              the walk of the headers plus numpy's count of 0xFF bytes and b"\\xff\\xda" pairs
  header      Image.open + draft + getexif against inference/jpeg_header.py's parser
  decoder     ImageDecoder.__call__ (the whole CPU decode: checks, simplejpeg, torch's resize)
              with both changes off (before), each one alone, and both on (after)

In one process, interleaved rounds (each round starts with another variant), microseconds per
call as medians with min-max over rounds; `saving` is the per-round difference before - after
(paired). Wall time and this process's CPU time, torch single-threaded so that both are one
core's work. The machine is shared: read the ratios, not the absolute numbers.

    .venv/bin/python -m bench.jpeg_header --out bench/results/jpeg-header.json
"""

from __future__ import annotations

import argparse
import functools
import io
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import ExifTags, Image

from bench.common import CLIP_SPEC, machine, rotated, spread, utc_now, write_report
from clipserve.inference import preprocess
from clipserve.inference.jpeg import fast_jpeg
from clipserve.inference.jpeg_header import drafted_size, read_header
from clipserve.inference.preprocess import ACCEPTED_FORMATS, ImageDecoder, check_structure

TARGET = 2 * 224  # the draft target of a 224 model at DRAFT_MARGIN 2


def photo(name: str, size: tuple[int, int], **params: object) -> bytes:
    """A scikit-image photo resized to `size`, as JPEG q90."""
    import skimage.data

    buf = io.BytesIO()
    pixels = getattr(skimage.data, name)()
    Image.fromarray(pixels).resize(size).save(buf, "JPEG", quality=90, **params)
    return buf.getvalue()


def chelsea_640x480() -> bytes:
    return photo("chelsea", (640, 480))


def other_files() -> dict[str, bytes]:
    """Where the structure check's bound helps less or not at all."""
    return {
        "astronaut 1920x1080": photo("astronaut", (1920, 1080)),
        "astronaut 4000x3000 (past the bound's size cap)": photo("astronaut", (4000, 3000)),
        "chelsea 640x480, a restart marker every block (bound fails)": photo(
            "chelsea", (640, 480), restart_marker_blocks=1
        ),
    }


@contextmanager
def walk_only(on: bool) -> Iterator[None]:
    """check_structure as it was: the counting bound never lets the walk stop early."""
    kept = preprocess._rest_within_limits
    if on:
        preprocess._rest_within_limits = lambda *_: False
    try:
        yield
    finally:
        preprocess._rest_within_limits = kept


def pillow_header(data: bytes) -> object:
    img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    img.draft(None, (TARGET, TARGET))
    return img.getexif().get(ExifTags.Base.Orientation, 1)


def parsed_header(data: bytes) -> object:
    header = read_header(data)
    assert header is not None
    return drafted_size(header.size, TARGET), header.orientation


Variant = tuple[Callable[[], object], bool]  # the call, and whether the walk runs whole


def measure(
    variants: dict[str, Variant], rounds: int, calls: int
) -> dict[str, dict[str, list[float]]]:
    """Microseconds per call, wall and process CPU, one value per round per variant."""
    out: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in variants}
    for r in range(rounds):
        for name in rotated(list(variants), r):
            fn, whole_walk = variants[name]
            with walk_only(whole_walk):
                fn()  # warm
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    fn()
                w1, c1 = time.perf_counter(), time.process_time()
            out[name]["wall"].append((w1 - w0) / calls * 1e6)
            out[name]["cpu"].append((c1 - c0) / calls * 1e6)
    return out


def summary(times: dict[str, dict[str, list[float]]], before: str, after: str) -> dict[str, object]:
    result: dict[str, object] = {
        name: {kind: spread(values, 1) for kind, values in kinds.items()}
        for name, kinds in times.items()
    }
    result["saving"] = {
        kind: spread(
            [b - a for b, a in zip(times[before][kind], times[after][kind], strict=True)], 1
        )
        for kind in ("wall", "cpu")
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300, help="calls per round and variant")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if fast_jpeg() is None:
        raise SystemExit("the fast JPEG path (simplejpeg, vectorised torch) is not installed")
    torch.set_num_threads(1)
    data = chelsea_640x480()
    decoders = {on: ImageDecoder(CLIP_SPEC, 40_000_000, read_headers=on) for on in (False, True)}
    assert np.array_equal(decoders[False](data), decoders[True](data))
    structure = measure(
        {
            "walk": (lambda: check_structure(data), True),
            "bound": (lambda: check_structure(data), False),
        },
        args.rounds,
        args.calls * 10,
    )
    header = measure(
        {
            "pillow open+draft+getexif": (lambda: pillow_header(data), False),
            "jpeg_header parser": (lambda: parsed_header(data), False),
        },
        args.rounds,
        args.calls * 10,
    )
    decoder = measure(
        {
            "before (walk, Pillow open)": (lambda: decoders[False](data), True),
            "bound only": (lambda: decoders[False](data), False),
            "parser only": (lambda: decoders[True](data), True),
            "after (bound, parser)": (lambda: decoders[True](data), False),
        },
        args.rounds,
        args.calls,
    )
    by_file: dict[str, object] = {}
    for name, other in other_files().items():
        check: Callable[[], object] = functools.partial(check_structure, other)
        times = measure(
            {"walk": (check, True), "bound": (check, False)},
            args.rounds,
            max(1, args.calls // 2),
        )
        by_file[f"{name} ({len(other)} bytes)"] = summary(times, "walk", "bound")
    report: dict[str, object] = {
        "benchmark": "bench/jpeg_header.py",
        "date": utc_now(),
        "machine": machine(),
        "python": platform.python_version(),
        "pillow": PIL.__version__,
        "decoder": decoders[True].jpeg_decoder,
        "image": f"skimage chelsea resized to 640x480, JPEG q90 ({len(data)} bytes)",
        "rounds": args.rounds,
        "unit": "microseconds per call; median, min, max over rounds",
        "structure_check": summary(structure, "walk", "bound"),
        "structure_check_other_files": by_file,
        "header": summary(header, "pillow open+draft+getexif", "jpeg_header parser"),
        "image_decoder_call": summary(
            decoder, "before (walk, Pillow open)", "after (bound, parser)"
        ),
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
