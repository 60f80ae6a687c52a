"""Round 3 of the JPEG work (issue 23): simplejpeg's n/8 DCT scales, each one's decode cost on
the 640x480 q90 image (this thread's CPU time, interleaved rounds; the machine is shared) and its
parity with open_clip's transform on scikit-image's photos. Run as a section of
bench/jpeg_decoders.py (`--sections scales --round round_3`).
"""

from __future__ import annotations

import argparse
import importlib
import io
import time
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from bench.common import CLIP_SPEC, rotated, spread
from bench.frontend.servers import affinity
from bench.jpeg_decoders import photos, torch_crop
from clipserve.loadgen.images import jpeg


def section_scales(a: argparse.Namespace) -> dict[str, Any]:
    """Each n/8 DCT scale simplejpeg offers: decode cost on the 640x480 image (thread CPU time,
    interleaved rounds; the machine is shared) and parity with open_clip on the photos."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from clipserve.backends.base import normalise_numpy

    simplejpeg = importlib.import_module("simplejpeg")  # untyped, optional: by name
    data = jpeg(640, 480, seed=1)
    us: dict[int, list[float]] = {n: [] for n in (8, 7, 6, 5, 4)}
    with affinity({a.core}):
        for r in range(a.rounds):
            for n in rotated(list(us), r):
                size = {"min_width": -(-640 * n // 8), "min_height": -(-480 * n // 8)}
                t0 = time.thread_time()
                for _ in range(50):
                    simplejpeg.decode_jpeg(data, "RGB", **size)
                us[n].append((time.thread_time() - t0) / 50 * 1e6)
    cfg = PreprocessCfg(size=224, mean=CLIP_SPEC.mean, std=CLIP_SPEC.std)
    transform = image_transform_v2(cfg, is_train=False)
    mean = np.asarray(CLIP_SPEC.mean)[:, None, None]
    std = np.asarray(CLIP_SPEC.std)[:, None, None]
    parity: dict[str, dict[str, Any]] = {}
    for photo, encoded in photos().items():
        ref = np.asarray(transform(ImageOps.exif_transpose(Image.open(io.BytesIO(encoded)))))
        ref_levels = np.clip(np.round((ref * std + mean) * 255), 0, 255)
        h, w, _, _ = simplejpeg.decode_jpeg_header(encoded)
        for n in us:
            sw, sh = -(-w * n // 8), -(-h * n // 8)
            if min(sw, sh) < 224:
                continue
            crop = torch_crop(simplejpeg.decode_jpeg(encoded, "RGB", min_width=sw, min_height=sh))
            tensor = normalise_numpy(crop[None], CLIP_SPEC)[0]
            levels = float(np.abs(crop.transpose(2, 0, 1) - ref_levels).mean())
            cos = float((tensor * ref).sum() / np.linalg.norm(tensor) / np.linalg.norm(ref))
            parity.setdefault(f"{n}/8", {})[photo] = {
                "margin": round(min(sw, sh) / 224, 2),
                "mean_abs_levels": round(levels, 3),
                "tensor_cosine": round(cos, 6),
            }
    rows = {}
    for n, samples in us.items():
        ratios = [b / x for b, x in zip(us[8], samples, strict=True)]
        mine = parity.get(f"{n}/8", {})
        rows[f"{n}/8"] = {
            "decode_us_640x480": spread(samples, 1),
            "speedup_vs_full_decode": spread(ratios, 3),
            "worst_mean_abs_levels": max(v["mean_abs_levels"] for v in mine.values()),
            "worst_tensor_cosine": min(v["tensor_cosine"] for v in mine.values()),
            "photos": mine,
        }
    return {"core": a.core, "rounds": a.rounds, "rows": rows}
