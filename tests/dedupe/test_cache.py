"""What survives between runs: the manifest, the embeddings by content hash, and a second
run that embeds only what changed (or what an interrupted run did not finish)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from clipserve.client import ServerGone
from clipserve.dedupe import cache, embed
from clipserve.dedupe.cache import EmbeddingStore, load_manifest, save_manifest
from clipserve.dedupe.cli import run
from clipserve.dedupe.scan import scan
from tests.dedupe.library import THRESHOLD, Recorder, write_photo


def args_for(folder: Path, out: Path, threshold: float = THRESHOLD) -> argparse.Namespace:
    return argparse.Namespace(
        paths=[folder], threshold=threshold, out=out, cache=None, index="exact"
    )


def library(folder: Path, n: int = 6) -> list[Path]:
    return [write_photo(folder / f"p{i}.jpg", seed=i) for i in range(n)]


def test_the_manifest_round_trips_and_a_corrupt_one_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    library(tmp_path / "photos", 3)
    photos = scan([tmp_path / "photos"]).photos
    save_manifest(tmp_path / "cache", photos)
    assert load_manifest(tmp_path / "cache") == {p.path: p for p in photos}
    (tmp_path / "cache" / cache.MANIFEST).write_text("{not json")
    assert load_manifest(tmp_path / "cache") == {}
    assert "every file is read again" in caplog.text


def test_the_manifest_forgets_deleted_files_and_keeps_other_folders(
    tmp_path: Path, recorder: Callable[..., Recorder]
) -> None:
    first, second = library(tmp_path / "a", 3), library(tmp_path / "b", 2)
    out, embedder = tmp_path / "out", recorder()
    run(args_for(tmp_path / "a", out), embedder)
    run(args_for(tmp_path / "b", out), embedder)
    manifest = load_manifest(out / "cache")
    assert set(manifest) == {str(p) for p in first + second}  # a's entries kept for its next run
    first[0].unlink()  # deleted under the folder scanned next
    second[0].unlink()  # and under a folder not scanned: gone all the same
    run(args_for(tmp_path / "a", out), embedder)
    assert set(load_manifest(out / "cache")) == {str(p) for p in first[1:] + second[1:]}


def test_the_store_keeps_embeddings_per_model(tmp_path: Path) -> None:
    vectors = np.eye(3, 4, dtype=np.float32)
    store = EmbeddingStore(tmp_path, "ViT-B-32/openai", 4)
    store.add(["a", "b"], vectors[:2])
    store.add(["c"], vectors[2:])
    again = EmbeddingStore(tmp_path, "ViT-B-32/openai", 4)
    assert len(again) == 3 and again.missing(["a", "c", "d"]) == ["d"]
    assert np.array_equal(again.vectors(["c", "a"]), vectors[[2, 0]])
    assert len(EmbeddingStore(tmp_path, "ViT-B-32/laion2b_s34b_b79k", 4)) == 0
    # Another preprocessing (a server under --jpeg-scaling fast): the same model, kept apart.
    fast = EmbeddingStore(tmp_path, "ViT-B-32/openai", 4, "jpeg-scaling-fast")
    assert len(fast) == 0 and fast.directory != again.directory
    fast.add(["a"], vectors[:1])
    assert len(EmbeddingStore(tmp_path, "ViT-B-32/openai", 4, "jpeg-scaling-fast")) == 1
    assert len(EmbeddingStore(tmp_path, "ViT-B-32/openai", 4)) == 3
    with pytest.raises(ValueError):
        store.add(["x"], np.ones((1, 5), np.float32))


def test_random_weights_are_never_cached(tmp_path: Path) -> None:
    store = EmbeddingStore(tmp_path, "ViT-B-32/random", 4)
    store.add(["a"], np.ones((1, 4), np.float32))
    assert "a" in store
    assert len(EmbeddingStore(tmp_path, "ViT-B-32/random", 4)) == 0
    assert not (tmp_path / "embeddings").exists()


def test_many_parts_are_compacted_into_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "MAX_PARTS", 2)
    store = EmbeddingStore(tmp_path, "m/w", 2)
    for i in range(4):
        store.add([f"h{i}"], np.array([[i, 1]], np.float32))
    store.compact()
    assert len(list(store.directory.glob("part-*.npz"))) == 1
    again = EmbeddingStore(tmp_path, "m/w", 2)
    assert np.array_equal(again.vectors(["h3", "h0"]), [[3, 1], [0, 1]])


def test_a_second_run_embeds_only_what_changed(
    tmp_path: Path, recorder: Callable[..., Recorder]
) -> None:
    photos = library(tmp_path / "photos")
    (tmp_path / "photos" / "copy.jpg").write_bytes(photos[0].read_bytes())  # exact copy
    out = tmp_path / "out"
    embedder = recorder()

    first = run(args_for(tmp_path / "photos", out), embedder)
    assert (first.embedded, embedder.sent) == (6, 6)  # 7 files, 6 contents: the copy is free
    assert [(g.kind, len(g.members)) for g in first.groups] == [("exact", 2)]

    second = run(args_for(tmp_path / "photos", out), embedder)
    assert (second.embedded, embedder.sent) == (0, 6)
    assert [[m.photo.path for m in g.members] for g in second.groups] == [
        [m.photo.path for m in g.members] for g in first.groups
    ]

    st = os.stat(photos[1])
    os.utime(photos[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
    assert run(args_for(tmp_path / "photos", out), embedder).embedded == 0  # hashed again only

    write_photo(photos[2], seed=100)  # new content under the same name
    assert run(args_for(tmp_path / "photos", out), embedder).embedded == 1
    assert embedder.sent == 7


def test_an_interrupted_run_resumes_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder: Callable[..., Recorder]
) -> None:
    monkeypatch.setattr(embed, "CHUNK", 2)
    library(tmp_path / "photos", 5)
    out = tmp_path / "out"
    with pytest.raises(ServerGone):
        run(args_for(tmp_path / "photos", out), recorder(fail_on_call=2))
    resumed = recorder()
    assert run(args_for(tmp_path / "photos", out), resumed).embedded == 3  # 2 were kept
    assert resumed.calls == 2
