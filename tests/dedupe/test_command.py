"""`clipserve dedupe` end to end on real photographs (scikit-image's samples) with the tiny
random model, in-process (--local) and against a running server (--url).

The tiny model's weights are random, so only edits its features survive are asserted: exact
copies, a JPEG re-encode at quality 30, a PNG conversion and an EXIF rotation all score
>= 0.9999 to their original, while these photos score <= 0.974 to each other (measured for
seed 1234; coffee and retina are left out: 0.9966 apart under these weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.dedupe_eval import write_set
from clipserve.cli import main
from tests.helpers import RunningServer

WITH_COPIES = ("astronaut", "rocket", "camera")
SINGLE = ("coins", "moon", "hubble_deep_field", "page")
KINDS = ("exact", "jpeg_q30", "png", "exif_rotate")
THRESHOLD = "0.995"


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, str]]]:
    folder = tmp_path_factory.mktemp("library")
    return folder, write_set(folder, WITH_COPIES, SINGLE, KINDS)


def expected_groups(truth: dict[str, tuple[str, str]]) -> set[frozenset[str]]:
    return {
        frozenset(p for p, (source, _) in truth.items() if source == name) for name in WITH_COPIES
    }


def found_groups(out: Path) -> tuple[set[frozenset[str]], dict[str, int]]:
    data = json.loads((out / "groups.json").read_text())
    return {frozenset(g["files"]) for g in data["groups"]}, data["counts"]


def test_help_lists_dedupe_and_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "'clipserve dedupe'" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["dedupe", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "usage: clipserve dedupe" in text and "--threshold" in text and "--local" in text
    assert "--max-batch-size" not in text  # none of the server's flags


def test_dedupe_refuses_url_with_local(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dedupe", ".", "--local", "--url", "http://127.0.0.1:1"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--batch-size", "0"], "--batch-size: must be at least 1"),
        (["--concurrency", "0"], "--concurrency: must be at least 1"),
        (["--retries", "-1"], "--retries: must be at least 0"),
        (["--timeout", "0"], "--timeout: must be a positive number"),
        (["--url", "127.0.0.1:8000"], "--url: must start with http://"),
    ],
)
def test_bad_flag_values_are_usage_errors(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dedupe", str(tmp_path), "--out", str(tmp_path / "o"), *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: clipserve dedupe") and says in err


def test_only_missing_paths_is_a_usage_error(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = ["--local", "--model", str(tiny_config), "--checkpoint", str(tiny_checkpoint)]
    argv = ["dedupe", *local, "--pretrained", "none", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exited:
        main([*argv, str(tmp_path / "gone"), str(tmp_path / "also gone")])
    assert exited.value.code == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main([*argv, str(tmp_path / "gone"), str(tmp_path)]) == 0  # one of them is there


def test_local_run_finds_exact_and_reencoded_copies_then_resumes(
    photos: tuple[Path, dict[str, tuple[str, str]]],
    tiny_config: Path,
    tiny_checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, truth = photos
    argv = [
        "dedupe",
        str(folder),
        "--local",
        "--model",
        str(tiny_config),
        "--checkpoint",
        str(tiny_checkpoint),
        "--pretrained",
        "none",
        "--threshold",
        THRESHOLD,
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    groups, counts = found_groups(tmp_path / "out")
    assert groups == expected_groups(truth)
    assert counts["photos"] == len(truth) and counts["skipped"] == 0
    assert counts["embedded"] == len(truth) - len(WITH_COPIES)  # each exact copy: not sent
    assert (tmp_path / "out" / "report.html").stat().st_size > 10_000  # thumbnails inside

    capsys.readouterr()
    assert main(argv) == 0
    assert found_groups(tmp_path / "out") == (groups, counts | {"embedded": 0})
    assert ", 0 embedded;" in capsys.readouterr().out


def test_remote_run_against_a_server(
    photos: tuple[Path, dict[str, tuple[str, str]]],
    serve: Callable[..., RunningServer],
    tmp_path: Path,
) -> None:
    folder, truth = photos
    server = serve()
    out = tmp_path / "out"
    argv = ["dedupe", str(folder), "--url", server.url, "--threshold", THRESHOLD]
    assert main([*argv, "--out", str(out), "--batch-size", "4"]) == 0
    groups, counts = found_groups(out)
    assert groups == expected_groups(truth)
    assert counts["embedded"] == len(truth) - len(WITH_COPIES)


def test_an_unreachable_server_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "http://127.0.0.1:9"
    argv = ["dedupe", str(tmp_path), "--url", url, "--retries", "0", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("clipserve dedupe: error: ") and len(err.strip().splitlines()) == 1


def test_a_server_under_jpeg_scaling_fast_keeps_its_own_embeddings(
    photos: tuple[Path, dict[str, tuple[str, str]]],
    serve: Callable[..., RunningServer],
    tmp_path: Path,
) -> None:
    """Its JPEG crops differ a little from open_clip's: one cache, two folders, nothing mixed."""
    folder, truth = photos
    cache = tmp_path / "cache"
    unique = len(truth) - len(WITH_COPIES)
    # Fast, parity, fast again: each setting embeds everything once, then finds its own.
    for run, (scaling, embedded) in enumerate([("fast", unique), ("parity", unique), ("fast", 0)]):
        server = serve(jpeg_scaling=scaling)
        out = tmp_path / f"out{run}"
        argv = ["dedupe", str(folder), "--url", server.url, "--threshold", THRESHOLD]
        assert main([*argv, "--out", str(out), "--cache", str(cache)]) == 0
        assert found_groups(out)[1]["embedded"] == embedded, (run, scaling)
    folders = sorted(p.name for p in (cache / "embeddings").iterdir())
    assert len(folders) == 2 and sum("jpeg-scaling-fast" in f for f in folders) == 1, folders
