"""Round 4 of the JPEG work (issue 23): where a served JPEG request's server CPU goes on the fast
path, and whether resizing less than the whole image can stay bit-exact. Run as sections of
bench/jpeg_decoders.py (`--sections attribution,passes,served --round round_4`).

  attribution  py-spy (raw stacks, 200 Hz) of the fast-path server at saturation, each sample
               put in one bucket (decode, resize kernel, header checks, the pool hop, the event
               loop, the device thread) and priced as its share of the server CPU per request
               measured in the same run (under py-spy, so a little above the unprofiled cost).
  passes       torch's uint8 AA resize as one call (what the fast path runs) against its
               horizontal pass alone, and against two one-axis calls with the centre crop taken
               between them (bit-exact: the kernel rounds to uint8 between its passes), on the
               640x480 image; thread CPU time, interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import CLIP_SPEC, rotated, spread
from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.load import requests_of, saturate
from bench.frontend.profile import STARTUP, profile
from bench.frontend.servers import affinity, clipserve, fake_flags
from clipserve.inference.jpeg import _aa_kernel, _torch_resize_crop, fast_jpeg
from clipserve.inference.preprocess import center_box, resized_size
from clipserve.loadgen.images import jpeg

# (bucket, thread name prefix or None for any, a substring of the leaf frame or None for any,
# a substring of the whole stack or None): the first rule that matches takes the sample.
RULES: list[tuple[str, str | None, str | None, str | None]] = [
    (
        "decode: simplejpeg (libjpeg-turbo)",
        "clipserve-decode",
        "<locals>.decode (clipserve/inf",
        None,
    ),
    ("resize: torch AA kernel (C++)", "clipserve-decode", "OpOverload.__call__", None),
    ("resize: Python around the kernel", "clipserve-decode", "_torch_resize_crop", None),
    ("header checks: structure walk", "clipserve-decode", None, "check_structure"),
    ("header checks: Pillow open, EXIF, sizes", "clipserve-decode", None, "ImageDecoder."),
    ("decode pool hop (futures, loop wake-up)", "clipserve-decode", None, None),
    ("event loop: uvloop C (sockets, HTTP parse)", "MainThread", "Runner.run (asyncio", None),
    ("event loop: Python (request path, batcher, JSON)", "MainThread", None, None),
    ("device thread (batch stack, fake executor)", "clipserve-cpu", None, None),
]


def bucket(thread: str, frames: list[str]) -> str:
    leaf, stack = frames[-1], ";".join(frames)
    for name, prefix, in_leaf, in_stack in RULES:
        if prefix is not None and not thread.startswith(prefix):
            continue
        if in_leaf is not None and in_leaf not in leaf:
            continue
        if in_stack is not None and in_stack not in stack:
            continue
        return name
    return "other threads"


def attribute(path: Path) -> Counter[str]:
    """Samples per bucket from py-spy's raw stacks (serving only: start-up stacks dropped)."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or any(s in stack for s in STARTUP):
            continue
        heads = list(re.finditer(r'process (\d+):"(.*?)";', stack))
        frames = [f for f in stack[heads[-1].end() :].split(";") if f] if heads else []
        thread = "?"
        if frames and frames[0].startswith("thread ("):
            thread = frames.pop(0).partition(": ")[2]
        if frames:
            counts[bucket(thread, frames)] += int(count)
    return counts


def section_attribution(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model = tmp / "fake-512-attribution.json"
    model.write_text(json.dumps(FAKE_CONFIG))
    reqs = requests_of("jpeg")
    server = clipserve("fast path (the default)", fake_flags(model))
    out = tmp / "attribution.txt"

    def point(r: Any) -> dict[str, Any]:
        saturate(r, reqs, 1.0, a.connections, 1)  # warm-up
        return saturate(r, reqs, a.profile_seconds, a.connections, 1)

    rows: list[dict[str, Any]] = []
    summary = profile(server, ({a.core}, {a.client_core}), point, out)
    counts = attribute(out)
    total = sum(counts.values()) or 1
    # profile() keeps the rate only; the CPU per request comes from the same point's row.
    rate = summary["under_py_spy"]["requests_per_s"]
    busy = summary["under_py_spy"]["server_cores_busy"]
    cpu_ms = busy / rate * 1000 if rate else 0.0
    for name, n in counts.most_common():
        rows.append(
            {
                "bucket": name,
                "share": round(n / total, 3),
                "ms_per_request": round(n / total * cpu_ms, 3),
            }
        )
    return {
        "under_py_spy": {**summary["under_py_spy"], "server_cpu_ms_per_request": round(cpu_ms, 3)},
        "samples": total,
        "rows": rows,
    }


def one_call(array: np.ndarray, size: tuple[int, int], box: tuple[int, int, int, int]) -> Any:
    return _torch_resize_crop(array, size, box, "bicubic")


def horizontal(array: np.ndarray, size: tuple[int, int], box: tuple[int, int, int, int]) -> Any:
    """The horizontal pass alone (height unchanged): what a column crop cannot shorten."""
    height = array.shape[0]
    return _torch_resize_crop(array, (size[0], height), (0, 0, size[0], height), "bicubic")


def split(array: np.ndarray, size: tuple[int, int], box: tuple[int, int, int, int]) -> Any:
    """Horizontal pass, the crop's columns (contiguous: a strided input takes a slow path),
    then the vertical pass over those columns only."""
    left, top, right, bottom = box
    rows = np.ascontiguousarray(horizontal(array, size, box)[:, left:right])
    width = right - left
    return _torch_resize_crop(rows, (width, size[1]), (0, top, width, bottom), "bicubic")


def section_passes(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    # As in a server pinned to one core (torch sizes its pool at import, before this pin).
    torch.set_num_threads(1)
    fast = fast_jpeg()
    if fast is None:
        return {"skipped": "the fast path does not load here"}
    _aa_kernel("bicubic")
    data = jpeg(640, 480, seed=1)
    array = fast.decode(data, (640, 480), 1.0)
    assert array is not None
    size = resized_size(640, 480, CLIP_SPEC)
    box = center_box(*size, CLIP_SPEC)
    same = bool(np.array_equal(one_call(array, size, box), split(array, size, box)))
    fns = {
        "one call (the fast path)": one_call,
        "horizontal pass only": horizontal,
        "split at the crop": split,
    }
    us: dict[str, list[float]] = {k: [] for k in fns}
    with affinity({a.core}):
        for r in range(a.rounds):
            for name in rotated(list(fns), r):
                t0 = time.thread_time()
                for _ in range(30):
                    fns[name](array, size, box)
                us[name].append((time.thread_time() - t0) / 30 * 1e6)
    base = us["one call (the fast path)"]
    return {
        "input": "640x480 q90 synthetic JPEG, decoded; resize to 298x224, crop 224x224",
        "clock": "thread CPU time",
        "split_bit_exact": same,
        "rows": {
            name: {
                "us": spread(samples, 1),
                "ratio_to_one_call": spread([x / b for x, b in zip(samples, base, strict=True)], 3),
            }
            for name, samples in us.items()
        },
    }


SECTIONS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "attribution": section_attribution,
    "passes": section_passes,
}
