"""The report files: groups.json's shape, the CSV, and HTML that shows thumbnails and escapes
every path (file names are untrusted text)."""

from __future__ import annotations

import argparse
import base64
import csv
import io
import json
import logging
import os
import re
import struct
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path
from shutil import which

import pytest
from PIL import Image

from clipserve.dedupe import report
from clipserve.dedupe.cli import run
from clipserve.dedupe.report import Outcome, as_html
from tests.dedupe.library import THRESHOLD, Recorder, picture, returns_within, write_photo

HOSTILE = "<img src=x onerror=alert(1)>.jpg"


@pytest.fixture
def dedupe(recorder: Callable[..., Recorder]) -> Callable[[Path, Path], Outcome]:
    def dedupe(folder: Path, out: Path) -> Outcome:
        args = argparse.Namespace(
            paths=[folder], threshold=THRESHOLD, out=out, cache=None, index="exact"
        )
        return run(args, recorder())

    return dedupe


def make_library(folder: Path) -> dict[str, Path]:
    """An exact pair, a re-encoded pair (one with a hostile name), a distinct photo and a
    broken file."""
    files = {
        "a": write_photo(folder / "a.jpg", seed=1),
        "distinct": write_photo(folder / "other.png", seed=2),
        "b": write_photo(folder / "b.png", seed=3),
        "hostile": folder / "sub" / HOSTILE,
        "quoted": folder / 'quote" and, comma.jpg',
        "broken": folder / "broken.webp",
    }
    files["hostile"].parent.mkdir()
    picture(3).save(files["hostile"], "JPEG", quality=60)
    files["quoted"].write_bytes(files["a"].read_bytes())
    files["broken"].write_bytes(b"RIFF\x00\x00\x00\x00WEBPVP8 junk")
    return files


def test_groups_json_has_the_documented_shape(
    tmp_path: Path, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    files = make_library(tmp_path / "photos")
    dedupe(tmp_path / "photos", tmp_path / "out")
    data = json.loads((tmp_path / "out" / "groups.json").read_text())
    assert set(data) == {
        "version",
        "model",
        "threshold",
        "similarity",
        "counts",
        "groups",
        "skipped",
    }
    assert data["model"].startswith("tiny-clip/sha256:") and data["threshold"] == THRESHOLD
    assert data["counts"] == {
        "photos": 5,
        "unique": 4,
        "embedded": 4,
        "groups": 2,
        "exact_groups": 1,
        "near_groups": 1,
        "duplicates": 2,
        "exact_copies": 1,
        "near_copies": 1,
        "skipped": 1,
    }
    near, exact = sorted(data["groups"], key=lambda g: g["kind"], reverse=True)
    assert exact == {
        "kind": "exact",
        "similarity": 1.0,
        "files": [str(files["a"]), str(files["quoted"])],  # same pixels: then by path
        "members": exact["members"],
    }
    assert [m["similarity"] for m in exact["members"]] == [1.0, 1.0]
    assert set(near["files"]) == {str(files["b"]), str(files["hostile"])}
    assert near["files"][0] == str(files["b"])  # same pixels, more bytes (PNG): first
    assert THRESHOLD <= near["similarity"] <= 1.0
    assert near["members"][1]["similarity"] == near["similarity"]  # two files: one pair
    assert set(near["members"][0]) == {
        "path",
        "similarity",
        "size",
        "width",
        "height",
        "sha256",
        "symlink",
        "copy_of",
    }
    assert [m["copy_of"] for m in exact["members"]] == [None, str(files["a"])]
    assert data["skipped"] == [
        {"path": str(files["broken"]), "reason": data["skipped"][0]["reason"]}
    ]


def test_the_csv_has_one_row_per_file_in_a_group(
    tmp_path: Path, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    files = make_library(tmp_path / "photos")
    dedupe(tmp_path / "photos", tmp_path / "out")
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out" / "groups.csv").read_text())))
    assert list(rows[0]) == list(report.CSV_COLUMNS)
    assert len(rows) == 4
    assert {r["path"] for r in rows} == {str(files[k]) for k in ("a", "quoted", "b", "hostile")}
    assert {r["group"] for r in rows} == {"1", "2"}


def test_html_escapes_every_path_and_embeds_thumbnails(
    tmp_path: Path, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    files = make_library(tmp_path / "photos")
    dedupe(tmp_path / "photos", tmp_path / "out")
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<img src=x" not in page and "onerror=alert(1)>" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;.jpg" in page
    assert "quote&quot; and, comma.jpg" in page
    assert page.count("(same bytes as file 1)") == 1  # the exact copy of a.jpg
    assert "<script" not in page
    assert "default-src &#x27;none&#x27;" not in page  # the policy itself is not escaped
    assert "content=\"default-src 'none'; img-src data:;" in page
    thumbnails = re.findall(r'<img src="data:image/jpeg;base64,[A-Za-z0-9+/=]+" alt="">', page)
    assert len(thumbnails) == 4
    assert page.count(f"{files['broken']}") == 1  # listed once among the skipped
    # Every href is a percent-encoded file: URI of the photo.
    assert "%3Cimg%20src%3Dx%20onerror%3Dalert%281%29%3E.jpg" in page


def test_thumbnails_are_upright_and_small(tmp_path: Path) -> None:
    path = tmp_path / "wide.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter clockwise: 400x200 pixels display as 200x400
    picture(1, size=(400, 200)).save(path, "JPEG", exif=exif.tobytes())
    uri = report.thumbnail(str(path))
    assert uri is not None
    with Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))) as thumb:
        assert thumb.size == (80, 160)
    assert report.thumbnail(str(tmp_path / "missing.jpg")) is None


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares `width` x `height` gray pixels, with one row of data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(bytes(width + 1)))
        + chunk(b"IEND", b"")
    )


def test_a_thumbnail_is_not_decoded_past_the_pixel_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The bound is the server's --max-image-pixels default, checked on the header before any
    pixel is decoded (Pillow's own limit would let each of 4 workers decode ~0.5 GB)."""
    assert report.THUMBNAIL_MAX_PIXELS == 40_000_000
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header(8000, 6000))  # 48 Mpx declared: over the bound, under Pillow's
    with caplog.at_level(logging.WARNING, "clipserve.dedupe.report"):
        assert report.thumbnail(str(bomb)) is None
    (message,) = [r.getMessage() for r in caplog.records]
    assert message == (
        f"no thumbnail for {bomb}: 8000x6000 image has 48000000 pixels to decode; the limit "
        "is 40000000 (the server's --max-image-pixels default)"
    )
    # A decodable photo over a smaller bound is refused the same way; a JPEG is bounded by the
    # pixels its reduced-size draft decodes (1600x1200 decodes 400x300 for a 160 px thumbnail).
    png = tmp_path / "a.png"
    picture(1, size=(400, 300)).save(png)
    assert report.thumbnail(str(png), max_pixels=400 * 300 - 1) is None
    assert report.thumbnail(str(png), max_pixels=400 * 300) is not None
    jpeg = tmp_path / "a.jpg"
    picture(1, size=(1600, 1200)).save(jpeg, "JPEG")
    assert report.thumbnail(str(jpeg), max_pixels=400 * 300) is not None
    assert report.thumbnail(str(jpeg), max_pixels=400 * 300 - 1) is None


def test_a_photo_swapped_for_a_fifo_gets_no_thumbnail_and_no_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    assert returns_within(lambda: report.thumbnail(str(fifo)), [fifo]) is None


def test_past_the_html_limit_groups_are_listed_in_json_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    make_library(tmp_path / "photos")
    outcome = dedupe(tmp_path / "photos", tmp_path / "out")
    monkeypatch.setattr(report, "MAX_HTML_GROUPS", 1)
    page = as_html(outcome)
    assert page.count("<section>") == 1
    assert "1 more groups, without previews: see groups.json" in page


CHROMIUM = next(
    (found for name in ("chromium", "chromium-browser", "google-chrome") if (found := which(name))),
    None,
)


@pytest.mark.skipif(
    CHROMIUM is None, reason="no headless Chromium here (chromium, chromium-browser, google-chrome)"
)
def test_the_report_renders_in_headless_chromium(
    tmp_path: Path, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    """The page as a browser builds it: four thumbnails, and the hostile name as text."""
    make_library(tmp_path / "photos")
    dedupe(tmp_path / "photos", tmp_path / "out")
    page = (tmp_path / "out" / "report.html").resolve().as_uri()
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", page],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    dom = done.stdout
    assert dom.count('<img src="data:image/jpeg;base64,') == 4
    assert '<img src="x"' not in dom
    assert "&lt;img src=x onerror=alert(1)&gt;.jpg" in dom

    # And as it is drawn: the thumbnails are pixels on screen, not broken-image icons.
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            "--window-size=1000,800",
            f"--screenshot={shot}",
            page,
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    with Image.open(shot) as drawn:
        colours = drawn.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 2000, len(colours)  # text on white alone draws a few hundred


def test_an_empty_folder_writes_an_empty_report(
    tmp_path: Path, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    (tmp_path / "photos").mkdir()
    outcome = dedupe(tmp_path / "photos", tmp_path / "out")
    assert (outcome.photos, outcome.groups, outcome.skipped) == (0, [], [])
    data = json.loads((tmp_path / "out" / "groups.json").read_text())
    assert (data["groups"], data["counts"]["photos"]) == ([], 0)
    assert "0 groups" in (tmp_path / "out" / "report.html").read_text()


def test_a_symlink_is_never_the_suggested_keep_and_is_labelled(
    tmp_path: Path, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    """A link named to sort first: the real file is still the one to keep, the link is the copy
    the report offers to delete, and it says it is a link."""
    real = write_photo(tmp_path / "photos" / "holiday.jpg", seed=1)
    link = tmp_path / "photos" / "0-shortcut.jpg"
    link.symlink_to(real)
    (group,) = dedupe(tmp_path / "photos", tmp_path / "out").groups
    assert [(m.photo.path, m.photo.link) for m in group.members] == [
        (str(real), False),
        (str(link), True),
    ]
    data = json.loads((tmp_path / "out" / "groups.json").read_text())
    assert [m["symlink"] for m in data["groups"][0]["members"]] == [False, True]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out" / "groups.csv").read_text())))
    assert [r["symlink"] for r in rows] == ["False", "True"]
    page = (tmp_path / "out" / "report.html").read_text()
    assert page.count("(symlink)") == 1
    assert page.index("(symlink)") > page.index("0-shortcut.jpg") > page.index("holiday.jpg")


def test_copies_the_model_cannot_take_are_still_an_exact_group(
    tmp_path: Path, dedupe: Callable[[Path, Path], Outcome]
) -> None:
    """Two byte-identical photos the model refuses (longer side 500 times the shorter: over the
    aspect limit) and one it takes: one exact group, each copy skipped under its own name."""
    strip = tmp_path / "photos" / "strip.png"
    strip.parent.mkdir()
    picture(1, size=(1000, 2)).save(strip)
    copy = tmp_path / "photos" / "strip copy.png"
    copy.write_bytes(strip.read_bytes())
    write_photo(tmp_path / "photos" / "other.png", seed=2)
    outcome = dedupe(tmp_path / "photos", tmp_path / "out")
    assert [(g.kind, g.similarity, [m.photo.path for m in g.members]) for g in outcome.groups] == [
        ("exact", 1.0, [str(copy), str(strip)])
    ]
    assert [m.similarity for m in outcome.groups[0].members] == [1.0, 1.0]
    reasons = {s.path: s.reason for s in outcome.skipped}
    assert set(reasons) == {str(strip), str(copy)}
    assert reasons[str(strip)] == reasons[str(copy)]
    assert (
        reasons[str(strip)].startswith("embedding failed: ") and "strip" not in reasons[str(copy)]
    )
    assert (outcome.photos, outcome.unique, outcome.embedded) == (3, 2, 2)
