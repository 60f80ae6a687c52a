"""Decoder choices: ms per image and pixel drift from open_clip's own transform.

Compares exact Pillow (what open_clip does), Pillow with JPEG draft at two margins and with
`reducing_gap`, and simplejpeg where installed. Writes bench/results/decoders.json.

    python -m bench.decoders per-core [--python NAME=PATH ...] [--rounds 9]

Per core: decode + resize + crop of 640x480 JPEGs on one pinned core, in interleaved rounds of
each interpreter (e.g. one with pillow-simd: docker/Dockerfile.cpu), medians with min and max.
Decoders: Pillow's draft path (the server's CPU default), Pillow exact, and torchvision's
libjpeg-turbo through the device decoder (inference/gpu_decode.py) where torch is installed.
Writes bench/results/decoders-per-core.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from bench.common import CLIP_SPEC, REPO, spread, timed, utc_now
from clipserve.inference import preprocess
from clipserve.inference.preprocess import ImageDecoder
from clipserve.loadgen.images import jpeg
from clipserve.loadgen.procs import cpu_model

SIZES = [(256, 256), (640, 480), (1920, 1080)]


def reference(data: bytes) -> np.ndarray:
    """open_clip's eval transform up to (not including) ToTensor/Normalize."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    t = image_transform_v2(PreprocessCfg(size=224), is_train=False)
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    for step in t.transforms[:-2]:  # drop ToTensor and Normalize
        img = step(img)
    return np.asarray(img)


def ms_per_call(fn: Callable[[bytes], object], data: bytes, repeat: int) -> float:
    """Median ms of `fn(data)`, after one call to warm up."""
    fn(data)
    return float(np.median(timed(lambda: fn(data), repeat)) * 1000)


def variants() -> dict[str, object]:
    out: dict[str, object] = {"exact": ImageDecoder(CLIP_SPEC, 10**9, fast=False)}
    for margin in (1, 2):

        def make(m: int = margin) -> object:
            dec = ImageDecoder(CLIP_SPEC, 10**9, fast=True)

            def run(data: bytes) -> np.ndarray:
                old = preprocess.DRAFT_MARGIN
                preprocess.DRAFT_MARGIN = m
                try:
                    return dec(data)
                finally:
                    preprocess.DRAFT_MARGIN = old

            return run

        out[f"draft_x{margin}+reducing_gap"] = make()
    try:
        import simplejpeg

        def sj(data: bytes) -> np.ndarray:
            arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=224, min_width=224)
            img = Image.fromarray(arr)
            w, h = preprocess.resized_size(*img.size, CLIP_SPEC)
            img = img.resize((w, h), Image.Resampling.BICUBIC)
            return np.asarray(img.crop(preprocess.center_box(w, h, CLIP_SPEC)))

        out["simplejpeg(min224)+bicubic"] = sj
    except ImportError:
        pass
    return out


def corpus(count: int = 16, size: tuple[int, int] = (640, 480)) -> list[bytes]:
    return [jpeg(size[0], size[1], seed=i) for i in range(count)]


def per_core_round(images: list[bytes], seconds: float, batch: int = 64) -> dict[str, float]:
    """One round in this interpreter, on one thread: ms per image for each decoder it has."""
    fast = ImageDecoder(CLIP_SPEC, 10**9)
    exact = ImageDecoder(CLIP_SPEC, 10**9, fast=False)

    def loop(fn: object) -> float:
        n, start = 0, time.perf_counter()
        while n < len(images) or time.perf_counter() - start < seconds:
            fn(images[n % len(images)])  # type: ignore[operator]
            n += 1
        return (time.perf_counter() - start) * 1000 / n

    out = {"pillow-draft": loop(fast), "pillow-exact": loop(exact)}
    try:
        import torch

        from clipserve.inference.gpu_decode import DeviceDecoder
    except ImportError:
        return out
    torch.set_num_threads(1)
    dev = DeviceDecoder(fast, "cpu")
    group = (images * (batch // len(images) + 1))[:batch]
    dev.decode(group)
    n, start = 0, time.perf_counter()
    while n == 0 or time.perf_counter() - start < seconds:
        dev.decode(group)
        n += len(group)
    out["torchvision-cpu (device decoder)"] = (time.perf_counter() - start) * 1000 / n
    return out


def per_core(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decoders per-core")
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another interpreter, e.g. pillow-simd=/tmp/simd/bin/python",
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=1.0, help="per decoder per round")
    parser.add_argument("--core", type=int, default=max(0, (os.cpu_count() or 1) - 1))
    parser.add_argument("--out", default="bench/results/decoders-per-core.json")
    args = parser.parse_args(argv)
    pythons = {"pillow": sys.executable}
    pythons.update(dict(item.split("=", 1) for item in args.python))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    samples: dict[str, list[float]] = {}
    versions = {}
    for r in range(args.rounds):
        for name, python in pythons.items():  # interleaved: a noisy moment hits every one
            cmd = ["taskset", "-c", str(args.core), python, "-m", "bench.decoders", "round"]
            cmd += ["--seconds", str(args.seconds)]
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            doc = json.loads(proc.stdout)
            versions[name] = doc.pop("_pillow")
            for decoder, ms in doc.items():
                samples.setdefault(f"{name}: {decoder}", []).append(ms)
        print(f"round {r + 1}/{args.rounds}", flush=True)
    rows = []
    base = samples["pillow: pillow-draft"]
    for key, ms in samples.items():
        ms_spread = spread(ms, 3)
        row: dict[str, object] = {
            "decoder": key,
            "ms_median": ms_spread["median"],
            "ms_min": ms_spread["min"],
            "ms_max": ms_spread["max"],
            "images_per_s_per_core": round(1000 / statistics.median(ms), 1),
        }
        # Paired within each round: noise common to a round cancels.
        ratios = [b / x for b, x in zip(base, ms, strict=True)]
        row["speedup_vs_pillow_draft"] = spread(ratios, 3)
        rows.append(row)
        print(row)
    doc = {
        "benchmark": "decoders-per-core",
        "machine": cpu_model(),
        "input": "640x480 q90 synthetic JPEG -> 224x224 uint8 crop",
        "core": args.core,
        "rounds": args.rounds,
        "seconds_per_round": args.seconds,
        "pillow": versions,
        "time": utc_now(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


def main() -> None:
    if sys.argv[1:2] == ["per-core"]:
        per_core(sys.argv[2:])
        return
    if sys.argv[1:2] == ["round"]:
        seconds = float(sys.argv[sys.argv.index("--seconds") + 1])
        result: dict[str, object] = dict(per_core_round(corpus(), seconds))
        from PIL import features

        turbo = features.version("libjpeg_turbo")
        result["_pillow"] = f"{Image.__version__}, libjpeg-turbo {turbo}"
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--out", default="bench/results/decoders.json")
    args = parser.parse_args()
    rows = []
    for w, h in SIZES:
        data = jpeg(w, h, seed=1)
        ref = reference(data).astype(np.int16)
        for name, fn in variants().items():
            pixels = fn(data).astype(np.int16)  # type: ignore[operator]
            diff = np.abs(pixels - ref)
            row = {
                "input": f"{w}x{h} q90",
                "decoder": name,
                "ms": round(ms_per_call(fn, data, args.repeat), 3),  # type: ignore[arg-type]
                "mean_abs_pixel_diff": round(float(diff.mean()), 3),
                "max_abs_pixel_diff": int(diff.max()),
            }
            rows.append(row)
            print(row)
    result = {
        "benchmark": "decoders",
        "machine": platform.processor() or platform.machine(),
        "pillow": Image.__version__,
        "threads": 1,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
