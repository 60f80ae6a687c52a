"""Decoder choices: ms per image and pixel drift from open_clip's own transform.

Compares exact Pillow (what open_clip does), Pillow with JPEG draft at two margins and with
`reducing_gap`, and simplejpeg where installed. Writes bench/results/decoders.json.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from bench.images import jpeg
from clipserve import preprocess
from clipserve.preprocess import ImageDecoder, PreprocessSpec

SPEC = PreprocessSpec(
    (224, 224), (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
)
SIZES = [(256, 256), (640, 480), (1920, 1080)]


def reference(data: bytes) -> np.ndarray:
    """open_clip's eval transform up to (not including) ToTensor/Normalize."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    t = image_transform_v2(PreprocessCfg(size=224), is_train=False)
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    for step in t.transforms[:-2]:  # drop ToTensor and Normalize
        img = step(img)
    return np.asarray(img)


def timed(fn, data: bytes, repeat: int) -> float:
    fn(data)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(data)
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples) * 1000)


def variants() -> dict[str, object]:
    out: dict[str, object] = {"exact": ImageDecoder(SPEC, 10**9, fast=False)}
    for margin in (1, 2):

        def make(m: int = margin) -> object:
            dec = ImageDecoder(SPEC, 10**9, fast=True)

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
            w, h = preprocess.resized_size(*img.size, SPEC)
            img = img.resize((w, h), Image.Resampling.BICUBIC)
            return np.asarray(img.crop(preprocess.center_box(w, h, SPEC)))

        out["simplejpeg(min224)+bicubic"] = sj
    except ImportError:
        pass
    return out


def main() -> None:
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
            rows.append({
                "input": f"{w}x{h} q90", "decoder": name,
                "ms": round(timed(fn, data, args.repeat), 3),  # type: ignore[arg-type]
                "mean_abs_pixel_diff": round(float(diff.mean()), 3),
                "max_abs_pixel_diff": int(diff.max()),
            })  # fmt: skip
            print(rows[-1])
    result = {
        "benchmark": "decoders", "machine": platform.processor() or platform.machine(),
        "pillow": Image.__version__, "threads": 1, "rows": rows,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
