"""bench/dedupe_eval.py's set and scoring, which the reported precision and recall rest on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from bench.dedupe_eval import exif_upright, score, write_set


def test_the_copies_are_what_their_kind_says(tmp_path: Path) -> None:
    truth = write_set(tmp_path, ("coffee",), ("moon",))
    by_kind = {kind: Path(p) for p, (source, kind) in truth.items() if source == "coffee"}
    original = by_kind["original"]
    assert by_kind["exact"].read_bytes() == original.read_bytes()
    formats = {}
    for kind, path in by_kind.items():
        with Image.open(path) as img:
            formats[kind] = (img.format, img.size)
    assert formats["png"] == ("PNG", (600, 400)) and formats["webp"][0] == "WEBP"
    assert formats["resize_50"][1] == (300, 200)
    assert formats["exif_rotate"] == ("JPEG", (400, 600))  # stored turned...
    upright = exif_upright(by_kind["exif_rotate"]).astype(int)
    assert np.abs(upright - exif_upright(original)).mean() < 3  # ...and shown upright
    assert truth[str(tmp_path / "moon.jpg")] == ("moon", "original")


def test_score_counts_pairs_and_copies_per_kind() -> None:
    truth = {
        "/a": ("a", "original"),
        "/a-exact": ("a", "exact"),
        "/a-png": ("a", "png"),
        "/b": ("b", "original"),
        "/b-png": ("b", "png"),
        "/c": ("c", "original"),
    }
    result = score([["/a", "/a-exact", "/c"], ["/b", "/b-png"]], truth)
    assert result["groups"] == 2 and result["false_pairs"] == 2  # a~c, a-exact~c
    assert result["precision"] == round(2 / 4, 3)  # a~a-exact, b~b-png of 4 pairs
    assert result["recall"] == round(2 / 4, 3)  # of a~a-exact, a~a-png, a-exact~a-png, b~b-png
    assert result["kinds"] == {
        "exact": {"copies": 1, "recall": 1.0, "precision": 0.5},
        "png": {"copies": 2, "recall": 0.5, "precision": 1.0},
    }
