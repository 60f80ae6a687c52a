"""JPEG decoders for the served path (issue 23): per-core cost, parity with open_clip, and served
JPEG requests per core, today's Pillow path against the fast path (inference/jpeg.py).

  decode   µs per 640x480 q90 JPEG -> 224x224 uint8 crop on one pinned core, interleaved rounds,
           paired speedups against Pillow's draft path (today's, and the fallback); plus the
           decode alone (DCT-scaled raster) per decoder. Candidates that are not dependencies
           (PyTurboJPEG 1.x with a system libturbojpeg, OpenCV) are measured where importable,
           e.g. from `pip install --target DIR` passed as --extra-path DIR.
  parity   each full candidate on scikit-image's sample photos (q90 JPEGs) against open_clip's
           own preprocess: mean and max |level| difference of the crop, cosine and mean |diff|
           of the normalised tensor.
  served   a real server per variant (fake backend, compute=0), all pinned to one core, wrk on
           the other, 64 connections, one 640x480 q90 JPEG per request, in interleaved rounds:
           requests/s and server CPU ms per request. Variants, all of this tree: Pillow at
           DRAFT_MARGIN 1 (today's decode, the baseline), Pillow at 2 (the fallback now), the
           fast path at 2 (the default) and at 1 (round 1's parity); simplejpeg is hidden and
           the margin set by a PYTHONPATH shim. Optionally the committed tree (--head).
  profile  py-spy of each served variant at saturation, summarised (bench/frontend/profile.py).
  scales   round 3: simplejpeg's n/8 DCT scales, each one's decode cost on the 640x480 image
           (interleaved, thread CPU time) and its parity with open_clip on the photos.

Round 7 (--round round_7 --sections served --rounds 9 --served-seconds 3): the served rows on
another machine (an AMD EPYC; rounds 1 to 6 ran on an Intel Xeon).
Round 6 (--round round_6 --sections served): round 4's rows and the fast path under
`--jpeg-scaling fast` (decoding to the model's size, as Pillow's draft did).
Round 4 (--round round_4): `attribution`, `passes` (bench/jpeg_serve.py); `served`: two rows.

Round 3 (--round round_3) adds the fast path's decode setting (inference/jpeg.py: plain chroma
upsampling where the resize shrinks >= 2x) as a served variant beside round 2's,
and writes its sections under that key of the existing JSON, keeping the earlier rows.

    python -m bench.jpeg_decoders --extra-path /tmp/jextra     # writes jpeg-decoders.json
    python -m bench.jpeg_decoders --round round_3 --sections served,scales,parity
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

import clipserve.inference.jpeg as jpeg_path
from bench.common import CLIP_SPEC, REPO, machine, rotated, say, spread, utc_now
from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.load import requests_of, saturate
from bench.frontend.profile import profile
from bench.frontend.servers import affinity, start_all
from bench.jpeg_variants import BASELINE, ROUND_2, ROUND_2_VARIANTS, ROUNDS, served_variants
from clipserve.inference.jpeg import FastJpeg, _torch_resize_crop, fast_jpeg
from clipserve.inference.preprocess import ImageDecoder, center_box, resized_size
from clipserve.loadgen.images import jpeg

Fn = Callable[[bytes], np.ndarray]
BICUBIC = Image.Resampling.BICUBIC


def fast_with(settings: dict[str, Any]) -> FastJpeg | None:
    """The fast path built with other decode settings (module constants read at build)."""
    old = {k: getattr(jpeg_path, k) for k in settings}
    for k, v in settings.items():
        setattr(jpeg_path, k, v)
    try:
        return jpeg_path._load()
    finally:
        for k, v in old.items():
            setattr(jpeg_path, k, v)


def plan(array: np.ndarray) -> tuple[tuple[int, int], slice, slice]:
    """open_clip's resize size for a decoded HWC array, and the centre crop's rows and columns."""
    h, w = array.shape[:2]
    size = resized_size(w, h, CLIP_SPEC)
    left, top, right, bottom = center_box(*size, CLIP_SPEC)
    return size, slice(top, bottom), slice(left, right)


def torch_crop(array: np.ndarray) -> np.ndarray:
    h, w = array.shape[:2]
    size = resized_size(w, h, CLIP_SPEC)
    box = center_box(*size, CLIP_SPEC)
    return np.ascontiguousarray(_torch_resize_crop(array, size, box, "bicubic"))


def pillow_crop(img: Image.Image) -> np.ndarray:
    size = resized_size(*img.size, CLIP_SPEC)
    return np.asarray(img.resize(size, BICUBIC).crop(center_box(*size, CLIP_SPEC)))


def draft_size(width: int, height: int, target: int = 2 * 224) -> tuple[int, int]:
    """The size Pillow's JPEG draft picks: the largest of 1/8, 1/4, 1/2 keeping both >= target
    (DRAFT_MARGIN x 224)."""
    scale = next((s for s in (8, 4, 2) if min(width, height) // s >= target), 1)
    return -(-width // scale), -(-height // scale)


def drafted(data: bytes, target: int = 2 * 224) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.draft(None, (target, target))
    img.load()
    return img


def candidates() -> tuple[dict[str, Fn], dict[str, Fn]]:
    """(full decode -> 224x224 crop, decode only) for every decoder importable here."""
    fast = ImageDecoder(CLIP_SPEC, 10**9)
    full: dict[str, Fn] = {
        BASELINE: ImageDecoder(CLIP_SPEC, 10**9, jpeg=None, draft_margin=1),
        "pillow draft margin 2 (the fallback now)": ImageDecoder(CLIP_SPEC, 10**9, jpeg=None),
    }
    only: dict[str, Fn] = {
        "pillow draft margin 1": lambda d: np.asarray(drafted(d, 224)),
        "pillow draft margin 2": lambda d: np.asarray(drafted(d)),
    }
    if fast.jpeg_decoder != "pillow":
        full["clipserve fast path (margin 2, the default)"] = fast
        full["clipserve fast path, round 2 (fancy upsampling)"] = ImageDecoder(
            CLIP_SPEC, 10**9, jpeg=fast_with(ROUND_2)
        )
        full["clipserve fast path at margin 1 (round 1's parity)"] = ImageDecoder(
            CLIP_SPEC, 10**9, draft_margin=1
        )
    full["pillow draft + torch resize"] = lambda d: torch_crop(
        np.asarray(drafted(d).convert("RGB"))
    )
    with contextlib.suppress(ImportError):
        simplejpeg = importlib.import_module("simplejpeg")  # untyped, optional: by name

        def sj(data: bytes, fastdct: bool = False, fastup: bool = False) -> np.ndarray:
            """At Pillow draft's scale, margin 2 (the fast path's)."""
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            mw, mh = draft_size(w, h)
            out: np.ndarray = simplejpeg.decode_jpeg(
                data, "RGB", fastdct, fastup, min_height=mh, min_width=mw
            )
            return out

        def sj_n8(data: bytes) -> np.ndarray:
            """At the least n/8 scale keeping both sides >= 1.5 x 224."""
            out: np.ndarray = simplejpeg.decode_jpeg(data, "RGB", min_height=336, min_width=336)
            return out

        only["simplejpeg margin 2"] = sj
        full["simplejpeg + pillow resize"] = lambda d: pillow_crop(Image.fromarray(sj(d)))
        full["simplejpeg fastupsample + torch"] = lambda d: torch_crop(sj(d, fastup=True))
        full["simplejpeg fastdct+fastupsample + torch"] = lambda d: torch_crop(sj(d, True, True))
        full["simplejpeg at n/8 scales (1.5x) + torch"] = lambda d: torch_crop(sj_n8(d))
    with contextlib.suppress(ImportError, RuntimeError, OSError):
        # PyTurboJPEG 1.x: needs the system's libturbojpeg (apt libturbojpeg0); 2.x needs 3.0.
        turbojpeg = importlib.import_module("turbojpeg")

        tj = turbojpeg.TurboJPEG()

        def tjd(data: bytes) -> np.ndarray:
            out: np.ndarray = tj.decode(
                data, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=(1, 2)
            )
            return out

        only["pyturbojpeg 1/2"] = tjd
        full["pyturbojpeg 1/2 + torch"] = lambda d: torch_crop(tjd(d))
    with contextlib.suppress(ImportError):
        cv2 = importlib.import_module("cv2")

        cv2.setNumThreads(1)

        def cvd(data: bytes) -> np.ndarray:
            bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_REDUCED_COLOR_2)
            return np.asarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))

        def cv_cubic(data: bytes) -> np.ndarray:
            array = cvd(data)
            size, rows, cols = plan(array)
            resized = np.asarray(cv2.resize(array, size, interpolation=cv2.INTER_CUBIC))
            return np.ascontiguousarray(resized[rows, cols])

        only["opencv reduced 1/2"] = cvd
        full["opencv reduced 1/2 + cv2 cubic (no antialias)"] = cv_cubic
        full["opencv reduced 1/2 + torch"] = lambda d: torch_crop(cvd(d))
    return full, only


def section_decode(a: argparse.Namespace) -> dict[str, Any]:
    full, only = candidates()
    images = [jpeg(640, 480, seed=i) for i in range(16)]
    fns = {
        **{f"full: {k}": v for k, v in full.items()},
        **{f"decode: {k}": v for k, v in only.items()},
    }
    us: dict[str, list[float]] = {k: [] for k in fns}
    # Round 3 on: this thread's CPU time, not wall time (other jobs share the 2 cores).
    clock = time.thread_time if a.round else time.perf_counter
    with affinity({a.core}):
        for r in range(a.rounds):
            for name in rotated(list(fns), r):  # interleaved: a noisy moment hits every one
                fn = fns[name]
                fn(images[0])
                n, t0 = 0, clock()
                while n < len(images) or clock() - t0 < a.seconds:
                    fn(images[n % len(images)])
                    n += 1
                us[name].append((clock() - t0) / n * 1e6)
            say(f"decode round {r + 1}/{a.rounds}")
    base = us[f"full: {BASELINE}"]
    rows: list[dict[str, Any]] = []
    for name, samples in us.items():
        ratios = [b / x for b, x in zip(base, samples, strict=True)]
        rows.append(
            {
                "decoder": name,
                "us_per_image": spread(samples, 1),
                "speedup_vs_pillow_draft": spread(ratios, 3),
            }
        )
        say(f"{name}: {spread(samples, 1)['median']} us, x{spread(ratios, 3)['median']}")
    return {
        "input": "640x480 q90 synthetic JPEG",
        "clock": "thread CPU time" if a.round else "wall",
        "core": a.core,
        "rounds": a.rounds,
        "rows": rows,
    }


def photos() -> dict[str, bytes]:
    import skimage.data

    folder = Path(skimage.data.__file__).parent
    out = {}
    for name in ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "camera.png"):
        img = Image.open(folder / name)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        out[f"{name} {img.width}x{img.height}"] = buf.getvalue()
    rocket = Image.open(folder / "rocket.jpg")
    for w, h in [(640, 480), (1920, 1080)]:
        buf = io.BytesIO()
        rocket.resize((w, h), Image.Resampling.LANCZOS).save(buf, "JPEG", quality=90)
        out[f"rocket {w}x{h}"] = buf.getvalue()
    out["retina.jpg 1411x1411"] = (folder / "retina.jpg").read_bytes()
    return out


def section_parity() -> dict[str, Any]:
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from clipserve.backends.base import normalise_numpy

    cfg = PreprocessCfg(size=224, mean=CLIP_SPEC.mean, std=CLIP_SPEC.std)
    transform = image_transform_v2(cfg, is_train=False)
    full, _ = candidates()
    rows: list[dict[str, Any]] = []
    for photo, data in photos().items():
        ref = np.asarray(transform(ImageOps.exif_transpose(Image.open(io.BytesIO(data)))))
        for name, fn in full.items():
            crop = fn(data)
            tensor = normalise_numpy(crop[None], CLIP_SPEC)[0]
            back = (
                ref * np.asarray(CLIP_SPEC.std)[:, None, None]
                + np.asarray(CLIP_SPEC.mean)[:, None, None]
            )
            levels = np.abs(
                crop.transpose(2, 0, 1).astype(np.float64) - np.clip(np.round(back * 255), 0, 255)
            )
            cos = float((tensor * ref).sum() / np.linalg.norm(tensor) / np.linalg.norm(ref))
            rows.append(
                {
                    "photo": photo,
                    "decoder": name,
                    "mean_abs_levels": round(float(levels.mean()), 3),
                    "max_abs_levels": int(levels.max()),
                    "tensor_mean_abs_diff": round(float(np.abs(tensor - ref).mean()), 5),
                    "tensor_cosine": round(cos, 6),
                }
            )
    summary = {}
    for name in full:
        mine = [r for r in rows if r["decoder"] == name]
        summary[name] = {
            "worst_tensor_cosine": min(r["tensor_cosine"] for r in mine),
            "median_tensor_cosine": float(np.median([r["tensor_cosine"] for r in mine])),
            "worst_mean_abs_levels": max(r["mean_abs_levels"] for r in mine),
            "median_mean_abs_levels": float(np.median([r["mean_abs_levels"] for r in mine])),
        }
    return {
        "reference": "open_clip image_transform_v2(size=224) after exif_transpose",
        "summary": summary,
        "rows": rows,
    }


def section_served(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model = tmp / "fake-512.json"
    model.write_text(json.dumps(FAKE_CONFIG))
    reqs = requests_of("jpeg")
    variants = ROUNDS.get(a.round, ROUND_2_VARIANTS)
    servers = served_variants(tmp, model, a.head, variants, a.before_tree)
    samples: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack, affinity({a.client_core}):
        up, skipped = start_all(stack, servers, {a.core})
        for r in up:
            saturate(r, reqs, 1.0, a.connections, 1)  # warm-up
        for i in range(a.rounds):
            for r in up[i % len(up) :] + up[: i % len(up)]:  # rotated: no variant always first
                row = saturate(r, reqs, a.served_seconds, a.connections, 1)
                samples.setdefault(r.server.name, []).append(row)
                ms = row["server_cpu_ms_per_request"]
                say(f"{r.server.name}: {row['requests_per_s']} req/s, {ms} CPU ms/request")
    base = samples[servers[0].name]
    out: dict[str, Any] = {"skipped": skipped, "rows": {}}
    for name, rows in samples.items():
        rate = [r["requests_per_s"] for r in rows]
        cpu = [r["server_cpu_ms_per_request"] for r in rows]
        out["rows"][name] = {
            "requests_per_s": spread(rate, 1),
            "server_cpu_ms_per_request": spread(cpu, 3),
            "speedup_req_per_s_vs_pillow": _paired(rows, base, "requests_per_s"),
            "speedup_cpu_per_request_vs_pillow": _paired(base, rows, "server_cpu_ms_per_request"),
            "failed": sum(r["failed"] for r in rows),
            "stage_ms_last_round": rows[-1].get("server_stage_ms"),
        }
    return out


def _paired(num: list[dict[str, Any]], den: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Round by round, `num`'s `key` over `den`'s: medians with spread."""
    return spread([x[key] / y[key] for x, y in zip(num, den, strict=True)], 3)


def section_profile(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model = tmp / "fake-512-profile.json"
    model.write_text(json.dumps(FAKE_CONFIG))
    reqs = requests_of("jpeg")
    out: dict[str, Any] = {}
    sub = tmp / "profile"
    sub.mkdir()
    for s in served_variants(sub, model, head=False)[0::2]:  # today's, and the default now
        point = functools.partial(
            saturate, reqs=reqs, seconds=a.profile_seconds, connections=a.connections, threads=1
        )
        summary = profile(s, ({a.core}, {a.client_core}), point, tmp / f"{len(out)}.txt")
        for proc in summary.get("processes", {}).values():
            for key in ("event_loop_thread_busy_lines", "loop_lines"):
                proc.pop(key, None)
        out[s.name] = summary
    return out


def write(a: argparse.Namespace, result: dict[str, Any]) -> None:
    """The results to --out; with --round, merged into that key of the file's JSON (sections
    not run this time, and earlier rounds, kept)."""
    if not a.round:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    whole = json.loads(a.out.read_text()) if a.out.exists() else {}
    whole.setdefault(a.round, {}).update(result)
    a.out.write_text(json.dumps(whole, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    assert __doc__
    p = argparse.ArgumentParser(
        prog="python -m bench.jpeg_decoders", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--sections", default="decode,parity,served,profile")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=1.0, help="per decoder per decode round")
    p.add_argument("--served-seconds", type=float, default=5.0)
    p.add_argument("--profile-seconds", type=float, default=5.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--core", type=int, default=0, help="the decoder's / server's core")
    p.add_argument("--client-core", type=int, default=1)
    p.add_argument("--head", action="store_true", help="served: also the committed tree")
    p.add_argument("--before-tree", type=Path, help="served: also this checkout, its defaults")
    p.add_argument("--extra-path", action="append", default=[], help="appended to sys.path")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "jpeg-decoders.json")
    p.add_argument(
        "--round", default="", help="write the sections under this key of --out, keeping the rest"
    )
    a = p.parse_args(argv)
    sys.path.extend(a.extra_path)
    sections = a.sections.split(",")
    result: dict[str, Any] = {
        "benchmark": "jpeg decoders (issue 23)",
        "date": utc_now(),
        "machine": machine(),
        "note": "2 shared cores, other jobs beside: medians of interleaved rounds, paired ratios",
        "fast_path": getattr(fast_jpeg(), "name", "not installed"),
        "git": subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for section in sections:
            say(f"section {section}")
            if section == "decode":
                result["decode"] = section_decode(a)
            elif section == "parity":
                result["parity"] = section_parity()
            elif section == "served":
                result["served"] = section_served(a, Path(tmp))
            elif section == "profile":
                result["profile"] = section_profile(a, Path(tmp))
            elif section == "scales":
                from bench.jpeg_scales import section_scales  # it imports this module

                result["scales"] = section_scales(a)
            elif section in ("attribution", "passes"):  # round 4
                from bench.jpeg_serve import SECTIONS

                result[section] = SECTIONS[section](a, Path(tmp))
            write(a, result)  # a partial run still reports
    say(f"wrote {a.out}")


if __name__ == "__main__":
    main()
