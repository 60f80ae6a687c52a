"""`clipserve dedupe` on real photographs: precision and recall of its groups per kind of copy.

    python -m bench.dedupe_eval [--model ViT-B-32 --pretrained none] [--quick]

The set: scikit-image's sample photos (colour ones, and grayscale ones as RGB), some of them
with generated near-duplicates: a byte copy, a JPEG re-encode at quality 30, a half-size
resize, a light crop, a brightness shift, an EXIF rotation (pixels turned, the orientation tag
turning them back), and format changes (PNG, WebP). The rest stay single: a group holding one
of them is a false one. The pipeline (scan, hash, embed, pairs, union-find) runs as the command
runs it, through clipserve.client in local mode, at several thresholds.

With `--pretrained none` (the default here: no trained weights on this machine) the model has
RANDOM weights: the numbers measure the pipeline and how far random features survive each
edit, not CLIP's accuracy. Users run trained weights. Writes
bench/results/dedupe-eval.json (or --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from bench.common import REPO, add_model_flags, describe_model, machine, say, utc_now

# Photos given near-duplicates, and photos left single. skimage's `cat` is `chelsea` (the
# same array), so only one of them is used.
WITH_COPIES = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "camera")
SINGLE = (
    "hubble_deep_field",
    "retina",
    "coins",
    "moon",
    "page",
    "text",
    "brick",
    "grass",
    "gravel",
    "clock",
    "cell",
)
THRESHOLDS = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99)
ORIENTATION = 0x0112  # EXIF tag: 6 = shown turned 90° clockwise


def photo(name: str) -> Image.Image:
    """A scikit-image sample as an RGB picture (grayscale ones converted)."""
    from skimage import data

    pixels = np.asarray(getattr(data, name)())
    if pixels.dtype == bool:
        pixels = pixels.astype(np.uint8) * 255
    img = Image.fromarray(pixels)
    return img.convert("RGB")


def _jpeg(img: Image.Image, path: Path, quality: int = 90, **kw: object) -> None:
    img.save(path.with_suffix(".jpg"), "JPEG", quality=quality, **kw)


def _exif_rotated(img: Image.Image, path: Path) -> None:
    """Pixels turned a quarter counter-clockwise, tagged to be shown turned back (upright)."""
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    _jpeg(img.transpose(Image.Transpose.ROTATE_90), path, exif=exif.tobytes())


def _crop(img: Image.Image, path: Path) -> None:
    w, h = img.size
    _jpeg(img.crop((w // 20, h // 20, w - w // 20, h - h // 20)), path)


# kind → how a copy is written from the original's pixels (path without suffix).
VARIANTS: dict[str, Callable[[Image.Image, Path], None]] = {
    "jpeg_q30": lambda img, p: _jpeg(img, p, quality=30),
    "resize_50": lambda img, p: _jpeg(img.resize((img.width // 2, img.height // 2)), p),
    "crop_10": _crop,
    "brightness": lambda img, p: _jpeg(ImageEnhance.Brightness(img).enhance(1.3), p),
    "exif_rotate": _exif_rotated,
    "png": lambda img, p: img.save(p.with_suffix(".png")),
    "webp": lambda img, p: img.save(p.with_suffix(".webp"), "WEBP", quality=80),
}
KINDS = ("exact", *VARIANTS)


def write_set(
    directory: Path,
    with_copies: Sequence[str] = WITH_COPIES,
    single: Sequence[str] = SINGLE,
    kinds: Sequence[str] = KINDS,
) -> dict[str, tuple[str, str]]:
    """Write the photos as JPEG q90 originals plus the copies; returns absolute path →
    (source photo, kind), kind "original" for the originals and the single photos."""
    directory.mkdir(parents=True, exist_ok=True)
    truth: dict[str, tuple[str, str]] = {}
    for name in (*with_copies, *single):
        img = photo(name)
        original = directory / f"{name}.jpg"
        _jpeg(img, original)
        truth[os.path.abspath(original)] = (name, "original")
        if name not in with_copies:
            continue
        for kind in kinds:
            stem = directory / f"{name}-{kind}"
            if kind == "exact":
                shutil.copyfile(original, stem.with_suffix(".jpg"))
            else:
                # From the decoded original, as a user's copy would be made from the file.
                with Image.open(original) as decoded:
                    VARIANTS[kind](decoded.convert("RGB"), stem)
            written = next(directory.glob(f"{name}-{kind}.*"))
            truth[os.path.abspath(written)] = (name, kind)
    return truth


def exif_upright(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(ImageOps.exif_transpose(img).convert("RGB"))


def score(groups: list[list[str]], truth: dict[str, tuple[str, str]]) -> dict[str, object]:
    """Pairwise precision and recall of `groups`, overall and per kind of copy: a copy is
    found if it shares a group with its original; a pair in a group is right if both files
    come from the same photo."""
    group_of = {path: i for i, files in enumerate(groups) for path in files}
    predicted = {
        tuple(sorted(pair)) for files in groups for pair in itertools.combinations(files, 2)
    }
    actual = {
        tuple(sorted(pair))
        for pair in itertools.combinations(truth, 2)
        if truth[pair[0]][0] == truth[pair[1]][0]
    }
    kinds: dict[str, dict[str, object]] = {}
    for kind in KINDS:
        copies = [p for p, (_, k) in truth.items() if k == kind]
        if not copies:
            continue
        originals = {truth[p][0]: p for p, (_, k) in truth.items() if k == "original"}
        found = sum(
            1 for p in copies if group_of.get(p, -1) == group_of.get(originals[truth[p][0]], -2)
        )
        involving = [
            pair for pair in predicted if truth[pair[0]][1] == kind or truth[pair[1]][1] == kind
        ]
        right = sum(1 for a, b in involving if truth[a][0] == truth[b][0])
        kinds[kind] = {
            "copies": len(copies),
            "recall": round(found / len(copies), 3),
            "precision": round(right / len(involving), 3) if involving else None,
        }
    hits = len(predicted & actual)
    return {
        "groups": len(groups),
        "precision": round(hits / len(predicted), 3) if predicted else None,
        "recall": round(hits / len(actual), 3) if actual else None,
        "false_pairs": len(predicted - actual),
        "kinds": kinds,
    }


def similarities(
    paths: Sequence[str], vectors: np.ndarray, truth: dict[str, tuple[str, str]]
) -> dict[str, dict[str, float]]:
    """Cosine of each kind of copy to its original, and between files of different photos
    (the "distinct" row): where a threshold can sit for this model."""
    row = {p: i for i, p in enumerate(paths)}
    originals = {truth[p][0]: p for p in paths if truth[p][1] == "original"}
    by_kind: dict[str, list[float]] = {}
    for p in paths:
        source, kind = truth[p]
        if kind != "original":
            by_kind.setdefault(kind, []).append(
                float(vectors[row[p]] @ vectors[row[originals[source]]])
            )
    cos = vectors @ vectors.T
    different = [
        float(cos[i, j])
        for i, j in itertools.combinations(range(len(paths)), 2)
        if truth[paths[i]][0] != truth[paths[j]][0]
    ]
    by_kind["distinct"] = different
    return {
        kind: {
            "min": round(min(v), 4),
            "median": round(float(np.median(v)), 4),
            "max": round(max(v), 4),
        }
        for kind, v in by_kind.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument("--quick", action="store_true", help="fewer photos")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/dedupe-eval.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from clipserve.client import Client
    from clipserve.dedupe.cli import run

    with_copies, single = (WITH_COPIES[:3], SINGLE[:4]) if args.quick else (WITH_COPIES, SINGLE)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "photos"
        truth = write_set(folder, with_copies, single)
        say(f"{len(truth)} files: {len(with_copies)} photos with copies, {len(single)} single")
        with Client(
            None,
            mode="local",
            model=args.model,
            pretrained=args.pretrained,
            checkpoint=args.checkpoint,
            progress=False,
        ) as client:
            paths = list(truth)
            embedded = client.embed_images_checked(paths)
            assert not embedded.errors, embedded.errors
            sims = similarities(paths, embedded.vectors, truth)
            by_threshold = {}
            for t in args.thresholds:
                run_args = argparse.Namespace(
                    paths=[folder],
                    threshold=t,
                    out=Path(tmp) / f"out-{t}",
                    cache=Path(tmp) / "cache",
                    index="exact",
                )
                outcome = run(run_args, client)
                assert not outcome.skipped, outcome.skipped
                groups = [[m.photo.path for m in g.members] for g in outcome.groups]
                by_threshold[f"{t:g}"] = score(groups, truth)
                say(f"threshold {t:g}: {by_threshold[f'{t:g}']}")
            model = client.info()["model"]
    result = {
        "benchmark": "dedupe-eval",
        "date": utc_now(),
        "machine": machine(),
        "model": describe_model(args),
        "model_identity": model,
        "weights_note": (
            "RANDOM weights (--pretrained none): measures the pipeline and how random "
            "features survive each edit, not CLIP's accuracy; users run trained weights"
            if args.pretrained == "none" and not args.checkpoint
            else "as named"
        ),
        "files": len(truth),
        "photos_with_copies": list(with_copies),
        "single_photos": list(single),
        "definitions": {
            "kind recall": "copies of this kind grouped with their original / copies",
            "kind precision": "pairs in a group involving a copy of this kind whose files come "
            "from the same photo / all such pairs",
            "overall": "pairwise precision and recall over every pair of files",
        },
        "cosine_to_original": sims,
        "by_threshold": by_threshold,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
