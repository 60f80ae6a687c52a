"""The ONNX export cache and the TensorRT engine cache: what counts as complete, what a failed or
killed write leaves, what the keys cover. The engine cache's folder, lock and retry logic runs
here with a stand-in for the session build (TensorRT needs a GPU)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clipserve.backends import onnx_export, registry
from clipserve.backends.base import ExecutorSpec
from clipserve.backends.onnx_export import (
    ExportedModel,
    cache_key,
    cached_export,
    folder_lock,
    import_onnxruntime,
    is_complete,
    meta_path,
    open_cached_export,
    session_options,
)
from clipserve.backends.ort import with_engine_cache
from clipserve.backends.registry import create_executor, resolve_devices
from clipserve.errors import StartupError
from clipserve.inference.commands import export_main
from tests.helpers import make_config


def staging_left(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if ".tmp-" in p.name] if root.is_dir() else []


def loads(exported: ExportedModel) -> None:
    options = session_options(exported.precision)  # fp16 needs its own (a crash otherwise)
    for path in (exported.image, exported.normalize):
        import_onnxruntime().InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )


def test_each_precision_has_its_own_marker_listing_file_sizes(
    tiny_loaded: Any, tmp_path: Path
) -> None:
    """Two precisions share a folder: each is complete by its own marker (`clipserve export`
    reads the cosine from it), and a graph whose size is not the marker's is exported again."""
    fp32 = cached_export(tiny_loaded, tmp_path, "fp32")
    fp16 = cached_export(tiny_loaded, tmp_path, "fp16")  # into the folder that exists
    assert fp16.directory == fp32.directory
    for exported, precision in ((fp32, "fp32"), (fp16, "fp16")):
        meta = json.loads(meta_path(exported.directory, precision).read_text())
        assert meta["precision"] == precision
        assert meta["files"][exported.image.name] == exported.image.stat().st_size
    size = fp32.image.stat().st_size
    with fp32.image.open("r+b") as f:  # a kill mid-copy, or weights moved to a lost .data file
        f.truncate(1000)
    again = cached_export(tiny_loaded, tmp_path, "fp32")
    assert again.image.stat().st_size == size
    loads(again)
    assert cached_export(tiny_loaded, tmp_path, "fp16").image.stat().st_mtime_ns == (
        fp16.image.stat().st_mtime_ns
    )  # the other precision's export is left as it was
    assert staging_left(tmp_path / "onnx") == []


def test_a_replica_waits_for_the_export_another_is_writing(
    tiny_loaded: Any, tmp_path: Path
) -> None:
    first = cached_export(tiny_loaded, tmp_path, "fp32")
    marker = meta_path(first.directory, "fp32")
    written = marker.read_text()
    marker.unlink()  # as while another replica installs it
    found: list[ExportedModel] = []
    with folder_lock(first.directory, "ONNX export"):  # that replica exporting
        waiter = threading.Thread(
            target=lambda: found.append(cached_export(tiny_loaded, tmp_path, "fp32"))
        )
        waiter.start()
        time.sleep(0.3)
        assert staging_left(tmp_path / "onnx") == [] and not found  # waiting, not exporting
        marker.write_text(written)  # what that replica moved in last
    waiter.join(60)
    assert found and found[0].reused  # its export, not a second one


def test_clipserve_export_reports_the_cosine_of_the_precision_asked_for(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def cosine(precision: str) -> str:
        config = make_config(tiny_config, tiny_checkpoint, precision=precision, cache_dir=tmp_path)
        assert export_main(config, None) == 0
        return capsys.readouterr().out.split("min cosine ")[1].split()[0]

    fp32 = cosine("fp32")
    assert cosine("fp16") != fp32
    assert cosine("fp32") == fp32  # reused from the cache, beside the fp16 export


def test_a_kill_while_moving_an_export_in_leaves_it_incomplete(
    tiny_loaded: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached_export(tiny_loaded, tmp_path, "fp32")  # the folder exists: files move one by one
    real_replace, moved = Path.replace, list[str]()

    def killed_after_one(self: Path, target: Any) -> Path:
        if moved:
            raise KeyboardInterrupt
        moved.append(self.name)
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        cached_export(tiny_loaded, tmp_path, "fp16")
    monkeypatch.undo()
    assert len(moved) == 1 and not moved[0].startswith("meta")
    assert not is_complete(
        tmp_path / "onnx" / cache_key(tiny_loaded, tiny_loaded.visual_digest), "fp16"
    )
    exported = cached_export(tiny_loaded, tmp_path, "fp16")
    assert not exported.reused and staging_left(tmp_path / "onnx") == []
    loads(exported)


def test_a_cached_graph_that_does_not_load_is_exported_again(
    tiny_loaded: Any, tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Damage of the same size, which the marker cannot see: ONNX Runtime refuses the graph."""
    config = make_config(tiny_config, tiny_checkpoint, backend="ort-cpu", cache_dir=tmp_path)
    spec = ExecutorSpec.from_config(config)
    exported = cached_export(tiny_loaded, tmp_path, "fp32")
    with exported.image.open("r+b") as f:
        f.write(b"\0" * 64)
    executor = create_executor(tiny_loaded, spec, "cpu")
    try:
        assert executor.run(np.zeros((2, 224, 224, 3), np.uint8)).shape == (2, 32)
    finally:
        executor.close()
    loads(exported)


def test_a_load_error_that_is_not_the_graphs_is_not_retried(
    tiny_loaded: Any, tmp_path: Path
) -> None:
    exported = cached_export(tiny_loaded, tmp_path, "fp32")
    mtime = exported.image.stat().st_mtime_ns
    calls = []

    def fails(got: Any) -> None:
        calls.append(got)
        raise RuntimeError("out of device memory")

    with pytest.raises(RuntimeError, match="out of device memory"):
        open_cached_export(tiny_loaded, tmp_path, "fp32", fails)
    assert len(calls) == 1 and exported.image.stat().st_mtime_ns == mtime  # not exported again
    with exported.image.open("r+b") as f:  # now damaged: exported again, then a StartupError
        f.write(b"\0" * 64)
    with pytest.raises(StartupError, match="cannot load"):
        open_cached_export(tiny_loaded, tmp_path, "fp32", fails)
    assert len(calls) == 3 and not calls[2].reused


@pytest.mark.parametrize("failure", [StartupError, KeyboardInterrupt])
def test_a_failed_export_leaves_no_staging_folder(
    failure: type[BaseException],
    tiny_loaded: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def disagrees(*_: Any, **__: Any) -> float:
        if failure is KeyboardInterrupt:
            raise KeyboardInterrupt
        return 0.5

    monkeypatch.setattr(onnx_export, "compare_with_torch", disagrees)
    with pytest.raises(failure):
        cached_export(tiny_loaded, tmp_path, "fp32")
    assert staging_left(tmp_path / "onnx") == []


def test_stale_staging_folders_are_swept_and_an_unwritable_cache_is_a_startup_error(
    tiny_loaded: Any, tmp_path: Path
) -> None:
    root = tmp_path / "onnx"
    old, recent = root / "m-1-2.tmp-41", root / "m-1-2.tmp-42"  # a writer may still be at work
    for folder in (old, recent):
        folder.mkdir(parents=True)
        (folder / "image-fp32.onnx").write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    cached_export(tiny_loaded, tmp_path, "fp32")
    assert staging_left(root) == [recent.name]

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(StartupError, match=r"cannot write the ONNX export cache.*--cache-dir"):
        cached_export(tiny_loaded, blocked / "cache", "fp32")


def test_the_cache_key_covers_what_changes_the_graph_but_not_the_weights(
    tiny_loaded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from open_clip.transformer import QuickGELU

    base = cache_key(tiny_loaded, "digest")
    assert cache_key(tiny_loaded, "digest") == base  # stable: reused across restarts
    module = copy.deepcopy(tiny_loaded.module)
    module.visual.transformer.resblocks[0].mlp.gelu = QuickGELU()  # no weights change
    variants = [
        dataclasses.replace(tiny_loaded, module=module),
        dataclasses.replace(
            tiny_loaded, preprocess=dataclasses.replace(tiny_loaded.preprocess, mean=(0.5,) * 3)
        ),
        dataclasses.replace(
            tiny_loaded, preprocess=dataclasses.replace(tiny_loaded.preprocess, std=(0.5,) * 3)
        ),
        dataclasses.replace(
            tiny_loaded,
            preprocess=dataclasses.replace(tiny_loaded.preprocess, interpolation="bilinear"),
        ),
    ]
    keys = {cache_key(model, "digest") for model in variants}
    assert len(keys) == len(variants) and base not in keys
    monkeypatch.setattr(onnx_export, "EXPORT_FORMAT", onnx_export.EXPORT_FORMAT + 1)
    assert cache_key(tiny_loaded, "digest") != base


# ---------------------------------------------------------------------------------------------
# The TensorRT engine cache (ort.with_engine_cache), with a stand-in for the session build


class Build:
    """Records the folders it is given and writes an engine file there, like ONNX Runtime."""

    def __init__(self, *errors: BaseException) -> None:
        self.folders: list[Path] = []
        self.errors = list(errors)

    def __call__(self, folder: Path) -> str:
        self.folders.append(folder)
        (folder / "model.engine").write_bytes(b"engine")
        if self.errors:
            raise self.errors.pop(0)
        return "session"


def test_engines_are_built_in_staging_and_renamed_after_the_warm_up(tmp_path: Path) -> None:
    engines, timing = tmp_path / "trt" / "trt10-sm90-fp16", tmp_path / "trt" / "trt10-sm90"
    build = Build()
    assert with_engine_cache(engines, timing, build) == "session"
    assert ".tmp-" in build.folders[0].name and build.folders[0].parent == engines.parent
    assert (engines / "model.engine").is_file() and timing.is_dir()
    assert staging_left(engines.parent) == []
    with_engine_cache(engines, timing, build)  # complete: loaded where it is
    assert build.folders[1] == engines

    failing = Build(RuntimeError("TensorRT EP failed to create engine from network"))
    other = tmp_path / "trt" / "trt10-sm90-fp32"
    with pytest.raises(RuntimeError, match="failed to create engine"):
        with_engine_cache(other, timing, failing)
    assert not other.exists() and staging_left(engines.parent) == []
    assert len(failing.folders) == 1  # not a cache that could not be read: not retried


@pytest.mark.parametrize(
    ("message", "built"),
    [  # engines found complete but unreadable; a timing cache unreadable while building
        ("TensorRT EP could not deserialize engine from cache: {engines}/model.engine", True),
        ("TensorRT EP could not create timing cache: {timing}/cache_sm90.timing", False),
    ],
)
def test_an_unreadable_engine_or_timing_cache_is_removed_and_built_once_more(
    message: str, built: bool, tmp_path: Path
) -> None:
    engines, timing = tmp_path / "engines", tmp_path / "timing"
    timing.mkdir()
    (timing / "cache_sm90.timing").write_bytes(b"damaged")
    if built:
        with_engine_cache(engines, timing, Build())
    error = RuntimeError(message.format(engines=engines, timing=timing))
    build = Build(error)
    assert with_engine_cache(engines, timing, build) == "session"
    assert len(build.folders) == 2 and ".tmp-" in build.folders[1].name
    assert (build.folders[0] == engines) is built
    assert (timing / "cache_sm90.timing").exists() is built  # the one that failed is removed
    assert timing.is_dir()  # and made again for the next build to write into
    assert (engines / "model.engine").is_file() and staging_left(tmp_path) == []

    shutil.rmtree(engines)
    twice = Build(error, error)
    with pytest.raises(RuntimeError, match="could not"):
        with_engine_cache(engines, timing, twice)
    assert len(twice.folders) == 2 and not engines.exists()


def test_one_process_builds_while_the_others_wait_for_its_engines(tmp_path: Path) -> None:
    engines, timing = tmp_path / "engines", tmp_path / "timing"
    build = Build()
    with folder_lock(engines, "TensorRT engine"):  # another replica is building
        waiter = threading.Thread(target=with_engine_cache, args=(engines, timing, build))
        waiter.start()
        time.sleep(0.3)
        assert build.folders == []
        engines.mkdir()  # what that replica renamed into place
    waiter.join(10)
    assert build.folders == [engines]


def test_an_unwritable_engine_cache_is_a_startup_error(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(StartupError, match="cannot write the TensorRT engine cache"):
        with_engine_cache(blocked / "engines", blocked / "timing", Build())


# ---------------------------------------------------------------------------------------------
# ort-cpu and --gpus


def test_ort_cpu_gets_the_cpu_from_gpus_auto_on_a_gpu_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "cuda_device_count", lambda: 1)
    assert resolve_devices("auto", "ort-cpu") == ["cpu"]
    assert resolve_devices("auto", "torch") == ["cuda:0"]


def test_ort_cpu_refuses_a_cuda_device(
    tiny_loaded: Any, tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    config = make_config(tiny_config, tiny_checkpoint, backend="ort-cpu", cache_dir=tmp_path)
    with pytest.raises(StartupError, match="--gpus cpu"):
        create_executor(tiny_loaded, ExecutorSpec.from_config(config), "cuda:0")
