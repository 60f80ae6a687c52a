"""A device's decoder in a process of its own (inference/decode_process.py), as `--decode gpu`
runs one per device when it serves several: the same crops and errors as the decoder in this
process, and a child that dies or cannot start is reported, never waited on for ever. Runs on the
CPU: the crops come back through shared memory where a GPU's would come through CUDA IPC."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from clipserve import errors
from clipserve.config import LimitsConfig
from clipserve.errors import ExecutorFatal, InvalidImage, StartupError
from clipserve.inference.decode_process import DecodeProcess
from clipserve.inference.gpu_decode import DeviceDecoder, crops_numpy
from clipserve.inference.nvjpeg import NvjpegOwner
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import jpeg
from tests.batching.test_worker_pixels import MAX_BATCH, bodies, build, serve
from tests.helpers import Serve

JPEG = {"Content-Type": "image/jpeg"}

SPEC = PreprocessSpec(
    size=(224, 224),
    mean=(0.48145466, 0.4578275, 0.40821073),
    std=(0.26862954, 0.26130258, 0.27577711),
    interpolation="bicubic",
    resize_mode="shortest",
)
LIMITS = LimitsConfig()


@pytest.fixture(scope="module")
def child(tiny_loaded: Any) -> Iterator[DecodeProcess]:
    """One child for the module, with the tiny model's spec (the executor test's too)."""
    process = DecodeProcess(tiny_loaded.preprocess, LIMITS, "cpu")
    process.wait_ready()
    yield process
    process.close()


def test_crops_and_errors_match_the_decoder_in_this_process(
    child: DecodeProcess, tiny_loaded: Any
) -> None:
    images = [jpeg(640, 480, seed=1), b"\xff\xd8 not a jpeg", jpeg(300, 500, seed=2)]
    host = ImageDecoder.from_limits(tiny_loaded.preprocess, LIMITS)
    here = DeviceDecoder(host, "cpu", owner=NvjpegOwner()).decode(images)
    there = child.decode(images)
    assert there.pixels.device == torch.device("cpu") and child.device == torch.device("cpu")
    assert there.pixels.is_shared()  # torch's sharing (CUDA IPC on a GPU), not a pickled copy
    assert there.ok == here.ok == [0, 2]
    assert np.array_equal(crops_numpy(there), crops_numpy(here))
    assert isinstance(there.errors[1], InvalidImage)
    assert there.errors[1].message == here.errors[1].message
    assert (there.on_device, there.on_host) == (here.on_device, here.on_host)
    again = child.decode([jpeg(640, 480, seed=1)])  # the child goes on after an error
    assert np.array_equal(crops_numpy(again)[0], crops_numpy(here)[0])


def test_its_crops_reach_a_torch_executor_as_they_are(
    child: DecodeProcess,
    tiny_loaded: Any,
    tiny_config: Path,
    tiny_checkpoint: Path,
    tmp_path: Path,
    host_copies: list[int],
) -> None:
    """The crops shared from the child are the executor's input, as the in-process decoder's
    are (tests/batching/test_worker_pixels.py): no host copy, the same rows."""
    ex = build("torch", tiny_loaded, tiny_config, tiny_checkpoint, tmp_path, "cpu")
    try:
        ex.warmup([1, MAX_BATCH])
        got, _ = serve(ex, child, bodies(), 1, host=False)
        assert host_copies == []
        here = DeviceDecoder(ImageDecoder(ex.spec, 40_000_000), "cpu", owner=NvjpegOwner())
        want, _ = serve(ex, here, bodies(), 1, host=True)
    finally:
        ex.close()
    for g, w in zip(got, want, strict=True):
        if isinstance(w, BaseException):
            assert type(g) is type(w)
        else:
            assert isinstance(g, np.ndarray) and np.allclose(g, w, atol=1e-5)


def test_a_batch_that_fails_in_the_child_fails_alone(child: DecodeProcess) -> None:
    """Not a per-image error (those come back in `errors`): the decoder itself raising. The
    batch fails as a failed forward pass would, and the child serves the next one."""
    with pytest.raises(RuntimeError, match="decode process for cpu: AttributeError"):
        child.decode([b"\xff\xd8", 3])  # type: ignore[list-item]
    assert child.decode([jpeg(64, 48)]).ok == [0]


def test_every_client_error_survives_the_pipe() -> None:
    """The child's per-image errors are pickled: each must come back as itself."""
    for name in dir(errors):
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, errors.ClipserveError):
            back = pickle.loads(pickle.dumps(cls("why")))
            assert type(back) is cls and back.message == "why" and back.code == cls.code


@pytest.mark.slow  # a child of its own: ~10 s to start here
def test_a_child_that_dies_fails_its_device_and_close_still_works() -> None:
    process = DecodeProcess(SPEC, LIMITS, "cpu")
    process.wait_ready()
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    with pytest.raises(ExecutorFatal, match="decode process for cpu"):
        process.decode([jpeg(64, 64)])
    process.close()
    process.close()  # idempotent
    with pytest.raises(ExecutorFatal, match="decode process for cpu is gone"):
        process.decode([jpeg(64, 64)])  # closed: refused at once, not waited on


@pytest.mark.slow
def test_a_child_too_slow_to_start_is_a_startup_error_and_is_stopped() -> None:
    process = DecodeProcess(SPEC, LIMITS, "cpu")
    with pytest.raises(StartupError, match="decode process for cpu did not start"):
        process.wait_ready(0.01)  # it imports torch first: seconds
    assert not process._process.is_alive()


@pytest.mark.slow
def test_a_child_that_cannot_start_is_a_startup_error() -> None:
    """No CUDA here: the child's decoder cannot take cuda:3, and says so."""
    if torch.cuda.is_available():
        pytest.skip("needs a host without CUDA")
    with pytest.raises(StartupError, match="decode process for cuda:3"):
        DecodeProcess(SPEC, LIMITS, "cuda:3").wait_ready(60)


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_two_devices_decode_in_a_process_each_and_serve_the_cpu_paths_embeddings(
    serve: Serve,
) -> None:
    """Two simulated devices, as two GPUs would be: a decode process each, and the same
    embeddings as the host decoder's (the fake backend's rows follow its input pixels)."""
    on_devices = serve(backend="fake", decode="gpu", gpus="0,1")
    on_cpu = serve(backend="fake")
    children = on_devices.state.runtime.device_decoders
    assert [type(d) for d in children] == [DecodeProcess, DecodeProcess]
    pids = [d.pid for d in children if isinstance(d, DecodeProcess)]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    bodies = [jpeg(640, 480, seed=s) for s in range(6)]

    async def embed(url: str) -> list[list[float]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            posts = [client.post("/embed", content=b, headers=JPEG) for b in bodies]
            answers = await asyncio.gather(*posts)
        assert [a.status_code for a in answers] == [200] * len(bodies)
        return [a.json()["embedding"] for a in answers]

    got, want = asyncio.run(embed(on_devices.url)), asyncio.run(embed(on_cpu.url))
    for g, w in zip(got, want, strict=True):
        assert float(np.dot(g, w)) > 0.999
    on_devices.state.runtime.close()
    assert all(not d._process.is_alive() for d in children if isinstance(d, DecodeProcess))
