"""Walking folders: what counts as a photo, what is skipped (and said so), what is reused."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from clipserve.dedupe import scan as scan_module
from clipserve.dedupe.cache import load_manifest, save_manifest
from clipserve.dedupe.cli import run
from clipserve.dedupe.scan import Skipped, scan
from tests.dedupe.library import THRESHOLD, Recorder, picture, returns_within, write_photo

FIFO = "not a regular file (a FIFO)"
DEVICE = "not a regular file (a character device)"
needs_dev_zero = pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")


def reasons(skipped: list[Skipped]) -> list[tuple[str, str]]:
    return [(Path(s.path).name, s.reason) for s in skipped]


def test_photos_are_found_and_unreadable_files_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = [write_photo(tmp_path / "a.jpg", 1), write_photo(tmp_path / "sub" / "B.PNG", 2)]
    write_photo(tmp_path / "c.webp", 3)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (tmp_path / "notes.txt").write_text("not a photo")
    write_photo(tmp_path / ".hidden.jpg", 4)
    write_photo(tmp_path / ".thumbnails" / "d.jpg", 5)  # a hidden folder is not entered

    with caplog.at_level(logging.WARNING, "clipserve.dedupe.scan"):
        found = scan([tmp_path])

    paths = [p.path for p in found.photos]
    assert paths == [str(good[0]), str(tmp_path / "c.webp"), str(good[1])]
    assert [p.format for p in found.photos] == ["JPEG", "WEBP", "PNG"]
    skipped = {Path(s.path).name: s.reason for s in found.skipped}
    assert set(skipped) == {"broken.jpg", "empty.png", "dangling.jpg"}
    assert skipped["dangling.jpg"].startswith("cannot stat")
    assert "not a readable" in skipped["empty.png"]
    assert found.ignored == 2  # notes.txt and .hidden.jpg
    assert found.read == 5  # the three photos and the two unreadable files
    assert sorted(r.getMessage().split(":")[0] for r in caplog.records) == sorted(
        f"skipped {tmp_path / name}" for name in skipped
    )


def test_a_photo_records_its_hash_size_and_pixels(tmp_path: Path) -> None:
    path = write_photo(tmp_path / "a.png", 1)
    (photo,) = scan([path]).photos
    data = path.read_bytes()
    assert photo.sha256 == hashlib.sha256(data).hexdigest()
    assert (photo.size, photo.width, photo.height) == (len(data), 96, 64)
    assert photo.mtime_ns == os.stat(path).st_mtime_ns


def test_a_missing_root_is_skipped_and_the_rest_still_scanned(tmp_path: Path) -> None:
    write_photo(tmp_path / "a.jpg", 1)
    found = scan([tmp_path / "gone", tmp_path, tmp_path / "a.jpg"])  # overlapping roots
    assert [Path(p.path).name for p in found.photos] == ["a.jpg"]  # named once
    assert [(Path(s.path).name, s.reason) for s in found.skipped] == [
        ("gone", "no such file or folder")
    ]


def test_a_known_file_is_trusted_until_its_size_or_mtime_changes(tmp_path: Path) -> None:
    path = write_photo(tmp_path / "a.jpg", 1)
    (first,) = scan([tmp_path]).photos
    marked = dataclasses.replace(first, sha256="from-the-manifest")
    again = scan([tmp_path], known={first.path: marked})
    assert again.photos == [marked] and again.read == 0

    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched
    touched = scan([tmp_path], known={first.path: marked})
    assert touched.read == 1
    assert touched.photos[0].sha256 == first.sha256  # read again: the real hash


def test_heic_is_passed_over_without_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scan_module, "heif_available", lambda: False)  # as if not installed
    (tmp_path / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic")
    found = scan([tmp_path])
    assert (found.photos, found.skipped, found.ignored) == ([], [], 1)


def test_heic_is_read_upright_and_grouped_with_its_jpeg(
    tmp_path: Path, recorder: Callable[..., Recorder]
) -> None:
    """An iPhone-style HEIC (stored sideways, EXIF orientation 6) of a JPEG in the library: the
    server does not decode HEIC, so dedupe sends it as upright JPEG bytes and groups the two."""
    pytest.importorskip("pillow_heif")
    original = write_photo(tmp_path / "photos" / "a.jpg", seed=7)
    write_photo(tmp_path / "photos" / "b.jpg", seed=8)
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed turned a quarter clockwise
    with Image.open(original) as img:
        img.transpose(Image.Transpose.ROTATE_90).save(
            tmp_path / "photos" / "IMG_0001.HEIC", "HEIF", quality=90, exif=exif.tobytes()
        )
    args = argparse.Namespace(
        paths=[tmp_path / "photos"],
        threshold=THRESHOLD,
        out=tmp_path / "out",
        cache=None,
        index="exact",
    )
    outcome = run(args, recorder())
    assert outcome.photos == 3 and outcome.skipped == []
    assert [sorted(Path(m.photo.path).name for m in g.members) for g in outcome.groups] == [
        ["IMG_0001.HEIC", "a.jpg"]
    ]


def test_a_file_replaced_with_its_mtime_put_back_is_read_again(tmp_path: Path) -> None:
    """`cp -p`, `rsync -t` and `touch -r` put the old mtime on new bytes of the same size: the
    inode (a new file moved in) or the ctime (bytes rewritten in place) still tell."""
    path, other = tmp_path / "a.png", tmp_path / "other.png"
    picture(1).save(path, compress_level=0)  # stored, not compressed: one size for any pixels
    picture(2).save(other, compress_level=0)
    assert path.stat().st_size == other.stat().st_size
    save_manifest(tmp_path / "cache", scan([path]).photos)
    (first,) = load_manifest(tmp_path / "cache").values()
    assert (first.ctime_ns, first.ino) == (path.stat().st_ctime_ns, path.stat().st_ino)

    def put_back(mtime_ns: int) -> None:
        os.utime(path, ns=(mtime_ns, mtime_ns))

    os.replace(other, path)  # a new inode under the old name
    put_back(first.mtime_ns)
    moved = scan([path], known={first.path: first})
    assert moved.read == 1 and moved.photos[0].sha256 != first.sha256

    time.sleep(0.05)  # past the kernel's timestamp tick: the rewrite gets a later ctime
    second = moved.photos[0]
    picture(3).save(path, compress_level=0)  # in place: the same inode, new bytes
    put_back(second.mtime_ns)
    if path.stat().st_ctime_ns == second.ctime_ns:  # a file system of coarse timestamps
        pytest.skip("the rewrite kept its ctime: this file system's ticks are over 50 ms")
    rewritten = scan([path], known={second.path: second})
    assert rewritten.read == 1 and rewritten.photos[0].sha256 != second.sha256


def test_a_file_name_that_is_not_utf8_is_skipped_and_named_escaped(
    tmp_path: Path, recorder: Callable[..., Recorder]
) -> None:
    """A Latin-1 name on Linux (`caf\\xe9.jpg`): skipped, counted, and every report stays UTF-8."""
    folder = tmp_path / "photos"
    write_photo(folder / "ok.jpg", 1)
    latin1 = os.path.join(os.fsencode(folder), b"caf\xe9.jpg")
    write_photo(Path(os.fsdecode(latin1)), 1)
    args = argparse.Namespace(
        paths=[folder], threshold=THRESHOLD, out=tmp_path / "out", cache=None, index="exact"
    )
    outcome = run(args, recorder())
    assert outcome.photos == 1 and outcome.groups == []
    assert [(s.path, s.reason) for s in outcome.skipped] == [
        (f"{folder}/caf\\xe9.jpg", "the file name is not valid UTF-8")
    ]
    data = json.loads((tmp_path / "out" / "groups.json").read_bytes())
    assert data["skipped"][0]["path"] == f"{folder}/caf\\xe9.jpg"
    (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    (tmp_path / "out" / "groups.csv").read_text(encoding="utf-8")


@needs_dev_zero
def test_fifos_and_devices_named_like_photos_are_skipped_unopened(tmp_path: Path) -> None:
    """`mkfifo fifo.jpg` would block the open forever and /dev/zero never ends: the scanner's
    stat says what they are and they are skipped, not opened, named or walked into."""
    good = write_photo(tmp_path / "a.jpg", 1)
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    (tmp_path / "zero.jpg").symlink_to("/dev/zero")
    # A 1 MiB bound: a regression that opens /dev/zero still stops, with the wrong reason.
    found = returns_within(lambda: scan([tmp_path], max_bytes=2**20), [fifo])
    assert [p.path for p in found.photos] == [str(good)]
    assert reasons(found.skipped) == [("fifo.jpg", FIFO), ("zero.jpg", DEVICE)]
    assert found.read == 1  # neither was opened
    named = returns_within(lambda: scan([fifo]), [fifo])  # a root, not "no such file"
    assert reasons(named.skipped) == [("fifo.jpg", FIFO)]


@needs_dev_zero
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_fifo_or_device_put_in_place_after_the_stat_is_not_read(
    tmp_path: Path, kind: str
) -> None:
    """Between the scanner's stat and its open a photo can become a FIFO or a link to a device:
    the open does not block and what was opened is checked again."""
    stat_then = os.stat(write_photo(tmp_path / "a.jpg", 1))
    swapped = tmp_path / "swapped.jpg"
    if kind == "fifo":
        os.mkfifo(swapped)
    else:
        swapped.symlink_to("/dev/zero")
    reason = returns_within(
        lambda: scan_module._read(str(swapped), stat_then, scan_module.FORMATS, 2**20), [swapped]
    )
    assert reason == (FIFO if kind == "fifo" else DEVICE)


def test_a_file_over_the_read_bound_is_skipped_and_the_rest_read(tmp_path: Path) -> None:
    good = write_photo(tmp_path / "a.jpg", 1)
    bound = good.stat().st_size  # a file of exactly the bound is read
    (tmp_path / "big.jpg").write_bytes(good.read_bytes() + b"\0")
    found = scan([tmp_path], max_bytes=bound)
    assert [p.path for p in found.photos] == [str(good)]
    assert reasons(found.skipped) == [("big.jpg", f"too large to be a photo (over {bound} bytes)")]
    assert scan_module.MAX_FILE_BYTES == 200 * 2**20  # the default: no photo is near it


def test_a_file_whose_size_understates_it_is_read_only_to_the_bound(tmp_path: Path) -> None:
    """A /proc file says 0 bytes and a file can grow while read: at most bound + 1 bytes are
    read, whatever fstat said."""
    f = io.BytesIO(bytes(1000))
    assert len(scan_module._read_at_most(f, 0, 100)) == 101 and f.tell() == 101
    f = io.BytesIO(bytes(50))
    assert scan_module._read_at_most(f, 50, 100) == bytes(50)
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc here")
    (tmp_path / "status.jpg").symlink_to(status)
    found = scan([tmp_path], max_bytes=100)
    assert reasons(found.skipped) == [("status.jpg", "too large to be a photo (over 100 bytes)")]


def test_running_out_of_memory_on_one_file_skips_only_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = write_photo(tmp_path / "a.jpg", 1)
    huge = write_photo(tmp_path / "huge.jpg", 2)
    real = scan_module._read_bounded

    def read(path: str, max_bytes: int) -> bytes:
        if path == str(huge):
            raise MemoryError
        return real(path, max_bytes)

    monkeypatch.setattr(scan_module, "_read_bounded", read)
    found = scan([tmp_path])
    assert [p.path for p in found.photos] == [str(good)]
    assert reasons(found.skipped) == [("huge.jpg", "cannot read: out of memory")]


@needs_dev_zero
def test_a_run_with_a_fifo_and_dev_zero_reports_them_and_groups_the_rest(
    tmp_path: Path, recorder: Callable[..., Recorder]
) -> None:
    folder = tmp_path / "photos"
    a = write_photo(folder / "a.jpg", 1)
    (folder / "copy.jpg").write_bytes(a.read_bytes())
    os.mkfifo(folder / "fifo.jpg")
    (folder / "zero.jpg").symlink_to("/dev/zero")
    args = argparse.Namespace(
        paths=[folder], threshold=THRESHOLD, out=tmp_path / "out", cache=None, index="exact"
    )
    outcome = returns_within(lambda: run(args, recorder()), [folder / "fifo.jpg"])
    assert [len(g.members) for g in outcome.groups] == [2]
    assert reasons(outcome.skipped) == [("fifo.jpg", FIFO), ("zero.jpg", DEVICE)]
    data = json.loads((tmp_path / "out" / "groups.json").read_bytes())
    assert data["counts"]["skipped"] == 2
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert f"{folder / 'fifo.jpg'}: {FIFO}" in page and "2 files skipped" in page
