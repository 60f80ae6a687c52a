"""`--decode gpu` into a torch executor on the decoder's device: the decoded batch's tensor is the
executor's input, with no host round trip. On this CPU the decoder is torchvision's
libjpeg-turbo path and the executors run the device layer's CPU side: the lines a GPU runs.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import clipserve.inference.gpu_decode as gpu_decode
from clipserve.backends import cuda_graphs, ort, torch_eager
from clipserve.backends.base import ExecutorSpec, l2_normalise_rows, takes_pixels
from clipserve.backends.torch_eager import TorchExecutor
from clipserve.batching.queue import Admission, BatchQueue, WorkItem
from clipserve.batching.worker import DeviceWorker
from clipserve.errors import ExecutorFatal, InvalidImage, NotReady
from clipserve.inference.gpu_decode import DecodedBatch, DeviceDecoder
from clipserve.inference.nvjpeg import NvjpegOwner
from clipserve.inference.preprocess import ImageDecoder
from clipserve.metrics import Metrics
from tests.helpers import corrupt_huffman, make_config, needs_cuda, until_async

MAX_BATCH = 8
NORMALIZE = [True, False, True, True, False, True, True]


def jpeg(seed: int, size: tuple[int, int] = (320, 240)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1] // 8, size[0] // 8, 3))
    image = Image.fromarray(pixels.astype(np.uint8)).resize(size, Image.Resampling.BICUBIC)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue()


class RecordingDecoder(DeviceDecoder):
    """The real decoder; it keeps each decoded batch so the test can follow its tensor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[DecodedBatch] = []

    def decode(self, images: Sequence[bytes], **kwargs: Any) -> DecodedBatch:
        batch = super().decode(images, **kwargs)
        self.batches.append(batch)
        return batch


class Failing(TorchExecutor):
    """The torch executor whose forward pass fails for batches above `limit` images, as CUDA
    does when a batch does not fit (`message` decides how the failure reads)."""

    limit = MAX_BATCH  # until the test lowers it: warm-up runs every size
    message = "CUDA out of memory. Tried to allocate 2.00 GiB"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise RuntimeError(self.message)
        return super().forward(x)


def build(
    kind: str, loaded: Any, tiny_config: Any, tiny_checkpoint: Any, cache: Path, device: str
) -> Any:
    config = make_config(
        tiny_config,
        tiny_checkpoint,
        backend=kind,
        gpus="cpu" if device == "cpu" else "0",
        max_batch_size=MAX_BATCH,
        cache_dir=str(cache),
    )
    spec = ExecutorSpec.from_config(config)
    if kind == "ort-cpu":
        return ort.create(loaded, spec, device)
    if kind == "cuda-graphs":
        return cuda_graphs.build(loaded, spec, device)
    if kind == "failing":
        return Failing(loaded, device, "fp32")
    return torch_eager.create(loaded, spec, device)


@pytest.fixture
def make_executor(
    tiny_loaded: Any, tiny_config: Any, tiny_checkpoint: Any, tmp_path: Path
) -> Iterator[Any]:
    made: list[Any] = []

    def make(kind: str, depth: int, device: str = "cpu") -> Any:
        ex = build(kind, tiny_loaded, tiny_config, tiny_checkpoint, tmp_path, device)
        if device == "cpu":  # the CPU's launch/wait are correct, only never overlapped
            ex.asynchronous = depth > 1
        ex.warmup([1, 2, 4, MAX_BATCH] if kind == "cuda-graphs" else [1, MAX_BATCH])
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


def serve(
    ex: Any,
    decoder: DeviceDecoder,
    bodies: list[bytes],
    depth: int,
    *,
    host: bool,
    dies: bool = False,
) -> tuple[list[np.ndarray | BaseException], DeviceWorker]:
    """`bodies` through a worker as one batch (`host`: the path that copies crops back;
    `dies`: the worker is expected to stop on its own, and is waited for)."""

    async def main() -> tuple[list[np.ndarray | BaseException], DeviceWorker]:
        queue, admission = BatchQueue(), Admission(100)
        worker = DeviceWorker(
            ex,
            queue,
            max_batch_size=MAX_BATCH,
            max_delay_s=0.0,
            metrics=Metrics(),
            pipeline_depth=depth,
            decoder=decoder,
        )
        if host:
            worker.pixels = None
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        items = [
            WorkItem(
                np.frombuffer(body, np.uint8),
                NORMALIZE[i],
                f"r{i}",
                loop.create_future(),
                admission.admit(1),
                now,
            )
            for i, body in enumerate(bodies)
        ]
        await queue.put(items)  # queued before the worker starts: one batch
        worker.start()
        try:
            futures = (item.future for item in items)
            got = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 60)
            if dies:
                await until_async(lambda: not worker.alive)
            return list(got), worker
        finally:
            await worker.stop()

    return asyncio.run(main())


def bodies() -> list[bytes]:
    images = [jpeg(seed, (320 + 16 * seed, 240)) for seed in range(len(NORMALIZE))]
    images[2] = corrupt_huffman(images[2])  # fails alone, at decode
    return images


def decoder_for(ex: Any) -> RecordingDecoder:
    host = ImageDecoder(ex.spec, 40_000_000)
    return RecordingDecoder(host, ex.pixel_device, owner=NvjpegOwner())


@pytest.mark.parametrize(
    ("kind", "depth"),
    [("torch", 1), ("torch", 2), ("cuda-graphs", 1), ("cuda-graphs", 2), ("ort-cpu", 1)],
)
def test_decoded_crops_go_to_the_executor_as_they_are(
    kind: str, depth: int, make_executor: Any, host_copies: list[int]
) -> None:
    check_crops_stay_on_the_device(make_executor(kind, depth), depth, host_copies, 1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["torch", "cuda-graphs"])
def test_on_cuda_decoded_crops_go_to_the_executor_as_they_are(
    kind: str, make_executor: Any, host_copies: list[int]
) -> None:
    """nvJPEG into the pipelined executor: stream order and `record_stream` on real streams."""
    check_crops_stay_on_the_device(make_executor(kind, 2, "cuda:0"), 2, host_copies, 2e-3)


def check_crops_stay_on_the_device(
    ex: Any, depth: int, host_copies: list[int], tolerance: float
) -> None:
    handed: list[torch.Tensor] = []
    entry = "launch_pixels" if depth > 1 else "run_pixels"
    real = getattr(ex, entry)

    def watched(pixels: torch.Tensor, *rest: Any) -> Any:
        handed.append(pixels)
        return real(pixels, *rest)

    setattr(ex, entry, watched)
    decoder = decoder_for(ex)
    assert id(takes_pixels(ex, str(decoder.device))) == id(ex)

    got, worker = serve(ex, decoder, bodies(), depth, host=False)

    assert host_copies == [] and id(worker.pixels) == id(ex)  # no row came back to the host
    assert len(decoder.batches) == 1 and len(handed) == 1
    assert handed[0] is decoder.batches[0].pixels  # the decoder's own tensor, not a copy
    assert isinstance(got[2], InvalidImage)  # the corrupt image failed alone
    # Row by row, the same embeddings as the path that copies the crops back to the host.
    before, _ = serve(ex, decoder_for(ex), bodies(), depth, host=True)
    assert host_copies == [len(NORMALIZE) - 1]
    for i, (row, want) in enumerate(zip(got, before, strict=True)):
        if i == 2:
            assert isinstance(want, InvalidImage)
            continue
        assert isinstance(row, np.ndarray) and isinstance(want, np.ndarray)
        np.testing.assert_allclose(row, want, rtol=tolerance, atol=tolerance / 10)
        assert (abs(np.linalg.norm(row) - 1) < 1e-5) == NORMALIZE[i]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_failing_batch_comes_to_the_host_only_to_be_bisected(
    depth: int, make_executor: Any, host_copies: list[int]
) -> None:
    ex = make_executor("failing", depth)
    ex.limit = 2
    images = [jpeg(seed) for seed in range(len(NORMALIZE))]
    got, worker = serve(ex, decoder_for(ex), images, depth, host=False)
    assert host_copies == [len(images)]  # once, for the bisection
    assert worker.alive is False and worker.error is None  # stopped by the test, not dead
    crops = np.stack([gpu_decode.crops_numpy(decoder_for(ex).decode([i])) for i in images])[:, 0]
    ex.limit = len(images)
    want = l2_normalise_rows(ex.run(crops), np.array(NORMALIZE))
    for row, expected in zip(got, want, strict=True):
        assert isinstance(row, np.ndarray)
        np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_lost_device_answers_the_batch_without_touching_its_crops(
    depth: int, make_executor: Any, host_copies: list[int]
) -> None:
    ex = make_executor("failing", depth)
    ex.limit = 2
    ex.message = "CUDA error: an illegal memory access was encountered"
    images = [jpeg(seed) for seed in range(4)]
    got, worker = serve(ex, decoder_for(ex), images, depth, host=False, dies=True)
    assert host_copies == []
    assert all(isinstance(row, NotReady) for row in got)
    assert worker.error is not None and worker.error.startswith(ExecutorFatal.__name__)


def test_pixels_must_fit_the_executors_input(make_executor: Any) -> None:
    ex = make_executor("torch", 2)
    h, w = ex.spec.size
    for bad in (
        torch.zeros((2, h, w, 3), dtype=torch.float32),
        torch.zeros((2, h, w + 1, 3), dtype=torch.uint8),
        torch.zeros((0, h, w, 3), dtype=torch.uint8),
        torch.zeros((2, h, w, 3), dtype=torch.uint8, device="meta"),
    ):
        with pytest.raises(ValueError, match="do not fit input"):
            ex.run_pixels(bad)
        with pytest.raises(ValueError, match="do not fit input"):
            ex.launch_pixels(bad, np.ones(2, dtype=bool))
    assert takes_pixels(ex, "cuda:0") is None  # another device: crops come through the host


def test_launched_pixels_match_run_inside_and_beyond_the_slots(make_executor: Any) -> None:
    ex = make_executor("torch", 2)
    h, w = ex.spec.size
    x = np.random.default_rng(3).integers(0, 256, (MAX_BATCH + 2, h, w, 3), dtype=np.uint8)
    mask = np.arange(len(x)) % 3 != 0
    for n in (3, MAX_BATCH + 2):  # in a slot; more than a slot holds (synchronous)
        pixels = torch.from_numpy(x[:n].copy())
        free = len(ex._free)
        got = ex.wait(ex.launch_pixels(pixels, mask[:n]))
        assert len(ex._free) == free
        want = l2_normalise_rows(ex.run(x[:n]), mask[:n])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(pixels.numpy(), x[:n])  # read, never written


def test_ort_binds_the_pixels_where_they_are(make_executor: Any) -> None:
    ex = make_executor("ort-cpu", 1)
    h, w = ex.spec.size
    x = np.random.default_rng(5).integers(0, 256, (3, h, w, 3), dtype=np.uint8)
    np.testing.assert_allclose(ex.run_pixels(torch.from_numpy(x)), ex.run(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit input"):
        ex.run_pixels(torch.from_numpy(x).permute(0, 2, 1, 3))  # not contiguous
    with pytest.raises(ValueError, match="exceeds the preallocated"):
        ex.run_pixels(torch.zeros((MAX_BATCH + 1, h, w, 3), dtype=torch.uint8))
