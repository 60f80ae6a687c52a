"""The torch executors' GPU code paths, run on the CPU through the device layer's real CPU side.

The staging-slot ring, launch/wait, graph capture and bucket replay are the lines a GPU runs;
here streams are the CPU's own (synchronous) and graphs replay eagerly into their static
buffers. What only a GPU can check (pinned memory, stream order) is `gpu`-marked below.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from clipserve.backends import cuda_graphs, torch_eager
from clipserve.backends.base import ExecutorSpec, as_async, l2_normalise_rows, normalise_numpy
from clipserve.backends.torch_device import (
    CpuDevice,
    CpuEvent,
    CudaDevice,
    EagerGraph,
    device_layer,
)
from clipserve.backends.torch_eager import TorchExecutor
from clipserve.batching.queue import Admission, BatchQueue, WorkItem
from clipserve.batching.worker import DeviceWorker
from clipserve.errors import StartupError
from clipserve.metrics import Metrics
from tests.helpers import make_config, needs_cuda

MAX_BATCH = 8


def images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)


def build(kind: str, loaded: Any, tiny_config: Any, tiny_checkpoint: Any) -> TorchExecutor:
    """The executor as its factory builds it, on the CPU (cuda-graphs: with eager replay)."""
    config = make_config(
        tiny_config, tiny_checkpoint, backend=kind, gpus="cpu", max_batch_size=MAX_BATCH
    )
    spec = ExecutorSpec.from_config(config)
    if kind == "cuda-graphs":
        return cuda_graphs.build(loaded, spec, "cpu")
    return torch_eager.create(loaded, spec, "cpu")


@pytest.fixture(params=["torch", "cuda-graphs"])
def executor(
    request: pytest.FixtureRequest, tiny_loaded: Any, tiny_config: Any, tiny_checkpoint: Any
) -> Iterator[TorchExecutor]:
    ex = build(request.param, tiny_loaded, tiny_config, tiny_checkpoint)
    ex.warmup([1, 2, 4, MAX_BATCH])
    yield ex
    ex.close()


def events_recorded(ex: TorchExecutor) -> tuple[int, int]:
    copied = sum(s.copied.recorded for s in ex._free if isinstance(s.copied, CpuEvent))
    done = sum(s.done.recorded for s in ex._free if isinstance(s.done, CpuEvent))
    return copied, done


# ---------------------------------------------------------------------------------------------
# The staging-slot ring and launch/wait


def test_launch_and_wait_match_run_and_own_their_rows(executor: TorchExecutor) -> None:
    assert not executor.asynchronous and as_async(executor) is None  # the CPU worker: run()
    assert len(executor._free) == 2 and events_recorded(executor) == (0, 0)
    batches = [images(5, seed) for seed in range(3)]
    mask = np.arange(5) % 2 == 0
    launched = [executor.launch(list(b), mask) for b in batches]  # three in flight at once
    assert not executor._free  # two slots made at warm-up, a third grown for the third batch
    rows = [executor.wait(handle) for handle in launched]
    assert len(executor._free) == 3 and {s.capacity for s in executor._free} == {MAX_BATCH}
    assert events_recorded(executor) == (3, 3)  # every batch's copy and completion recorded
    for batch, got in zip(batches, rows, strict=True):
        want = l2_normalise_rows(executor.run(batch), mask)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(got[mask], axis=1), 1.0, rtol=1e-5)
    kept = rows[0].copy()
    executor.wait(executor.launch(list(images(5, 9)), mask))  # reuses a slot
    np.testing.assert_array_equal(rows[0], kept)  # the caller's rows are its own
    assert not np.shares_memory(rows[0], rows[1])


def test_a_failed_launch_gives_its_slot_back(executor: TorchExecutor) -> None:
    good = images(2, 0)
    with pytest.raises(ValueError):  # the second image's shape does not fit the slot
        executor.launch([good[0], good[1, :100]], np.ones(2, dtype=bool))
    assert len(executor._free) == 2
    got = executor.wait(executor.launch(list(good), np.zeros(2, dtype=bool)))
    np.testing.assert_allclose(got, executor.run(good), rtol=1e-5, atol=1e-6)


def test_float_input_runs_synchronously(executor: TorchExecutor) -> None:
    x = images(3, 4)
    mask = np.array([True, False, True])
    handle = executor.launch(list(normalise_numpy(x, executor.spec)), mask)
    assert len(executor._free) == 2  # it took no slot
    want = l2_normalise_rows(executor.run(x), mask)
    np.testing.assert_allclose(executor.wait(handle), want, rtol=1e-4, atol=1e-5)


def test_a_batch_above_the_slots_runs_synchronously(
    tiny_loaded: Any, tiny_config: Any, tiny_checkpoint: Any
) -> None:
    ex = build("torch", tiny_loaded, tiny_config, tiny_checkpoint)
    try:
        ex.prepare_staging(2)
        x, mask = images(3, 4), np.ones(3, dtype=bool)
        handle = ex.launch(list(x), mask)
        assert len(ex._free) == 2
        want = l2_normalise_rows(ex.run(x), mask)
        np.testing.assert_allclose(ex.wait(handle), want, rtol=1e-5, atol=1e-6)
    finally:
        ex.close()


def test_slots_made_before_the_ring_is_resized_are_dropped(
    tiny_loaded: Any, tiny_config: Any, tiny_checkpoint: Any
) -> None:
    ex = build("torch", tiny_loaded, tiny_config, tiny_checkpoint)
    try:
        one = images(1, 0)
        early = ex.launch(list(one), np.ones(1, dtype=bool))  # before warm-up: a slot of 1
        ex.prepare_staging(4)
        np.testing.assert_allclose(
            ex.wait(early), l2_normalise_rows(ex.run(one), np.ones(1, dtype=bool)), atol=1e-6
        )
        assert [s.capacity for s in ex._free] == [4, 4]
    finally:
        ex.close()


def test_a_read_only_batch_runs_unchanged(executor: TorchExecutor) -> None:
    x = images(2, 5)
    frozen = x.copy()
    frozen.flags.writeable = False  # e.g. straight from PIL
    np.testing.assert_array_equal(executor.run(frozen), executor.run(x))


# ---------------------------------------------------------------------------------------------
# Graph buckets


def test_graph_buckets_pad_replay_and_match_eager(
    tiny_loaded: Any, tiny_config: Any, tiny_checkpoint: Any
) -> None:
    graphs = build("cuda-graphs", tiny_loaded, tiny_config, tiny_checkpoint)
    eager = build("torch", tiny_loaded, tiny_config, tiny_checkpoint)
    try:
        assert isinstance(graphs, cuda_graphs.CudaGraphExecutor)
        graphs.warmup([1])  # captures every bucket, whatever the sizes given
        assert sorted(graphs._graphs) == [1, 2, 4, MAX_BATCH]
        bucket4 = graphs._graphs[4][0]
        assert isinstance(bucket4, EagerGraph) and bucket4.replays == 0
        x = images(3, 7)
        first = graphs.run(x)  # padded to the bucket of 4
        assert bucket4.replays == 1
        np.testing.assert_allclose(first, eager.run(x), rtol=1e-5, atol=1e-6)
        kept = first.copy()
        graphs.run(images(4, 8))  # rewrites the same static output
        np.testing.assert_array_equal(first, kept)  # the earlier result was copied out
        floats = normalise_numpy(x, graphs.spec)  # float input runs eagerly
        np.testing.assert_allclose(graphs.run(floats), first, rtol=1e-4, atol=1e-5)
        assert bucket4.replays == 2
        assert graphs.info.backend == "cuda-graphs" and graphs.memory() is None
    finally:
        graphs.close()
        eager.close()


def test_eager_graph_reads_its_static_input_at_replay() -> None:
    static_in = torch.ones(3)
    graph, static_out = CpuDevice().capture(lambda: static_in * 2, None, CpuDevice().stream())
    assert static_out.tolist() == [2.0, 2.0, 2.0]
    static_in.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert static_out.tolist() == [2.0, 2.0, 2.0]  # until replayed
    graph.replay()
    assert static_out.tolist() == [2.0, 4.0, 6.0]


# ---------------------------------------------------------------------------------------------
# The pipelined worker over the CPU's launch/wait


def test_the_pipelined_worker_drives_launch_and_wait(
    tiny_loaded: Any, tiny_config: Any, tiny_checkpoint: Any
) -> None:
    """As on a GPU: depth 2, launch on the device thread, wait on the completion thread."""
    ex = build("torch", tiny_loaded, tiny_config, tiny_checkpoint)
    ex.asynchronous = True  # the CPU's launch/wait are correct, only never overlapped
    ex.warmup([1, 4])  # now also one launch through the staging
    assert as_async(ex) is ex and len(ex._free) == 2 and events_recorded(ex) == (1, 1)
    x = images(6, 11)
    normalize = [True, False, True, True, False, True]

    async def main() -> list[np.ndarray]:
        queue, admission = BatchQueue(), Admission(100)
        worker = DeviceWorker(
            ex, queue, max_batch_size=4, max_delay_s=0.0, metrics=Metrics(), pipeline_depth=2
        )
        assert worker.depth == 2
        worker.start()
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        items = [
            WorkItem(x[i], normalize[i], f"r{i}", loop.create_future(), admission.admit(1), now)
            for i in range(6)
        ]
        try:
            await queue.put(items)
            return list(await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), 30))
        finally:
            await worker.stop()

    got = np.stack(asyncio.run(main()))
    np.testing.assert_allclose(
        got, l2_normalise_rows(ex.run(x), np.array(normalize)), rtol=1e-5, atol=1e-6
    )
    assert events_recorded(ex)[1] >= 3  # warm-up's launch and the worker's two batches
    ex.close()


# ---------------------------------------------------------------------------------------------
# The layer itself


def test_layers_by_device() -> None:
    assert isinstance(device_layer(torch.device("cpu")), CpuDevice)
    assert isinstance(device_layer(torch.device("cuda", 1)), CudaDevice)  # touches no driver
    with pytest.raises(ValueError, match="no device layer for meta"):
        device_layer(torch.device("meta"))
    assert torch_eager.own_stream(torch.device("cpu")) is None


def test_cpu_staging_and_download_own_their_memory() -> None:
    cpu = CpuDevice()
    frozen = np.arange(6, dtype=np.uint8).reshape(2, 3)
    frozen.flags.writeable = False
    staged = cpu.stage(frozen)
    assert staged.tolist() == frozen.tolist() and not staged.is_pinned()
    assert not np.shares_memory(staged.numpy(), frozen)
    writable = np.arange(4, dtype=np.float32)
    assert np.shares_memory(cpu.stage(writable).numpy(), writable)  # no copy needed
    static = torch.arange(4, dtype=torch.float32)
    out = cpu.download(static)
    static.zero_()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert cpu.host_empty((2,), torch.uint8).is_pinned() is False
    assert cpu.memory() is None and cpu.graph_pool() is None
    event = cpu.event(blocking=True)
    stream = cpu.stream()
    event.record(stream)
    stream.wait_event(event)
    event.synchronize()
    stream.synchronize()
    assert isinstance(event, CpuEvent) and event.recorded == 1


def test_cuda_graphs_factory_refuses_the_cpu_and_buckets_below_one(
    tiny_loaded: Any, tiny_config: Any, tiny_checkpoint: Any
) -> None:
    """The server never serves eager replay: `create` refuses a CPU device even when called
    directly (the registry refuses it first)."""
    spec = ExecutorSpec.from_config(make_config(tiny_config, tiny_checkpoint))
    with pytest.raises(StartupError, match=r"cuda-graphs needs a CUDA device.*cpu"):
        cuda_graphs.create(tiny_loaded, spec, "cpu")
    with pytest.raises(StartupError, match="--batch-buckets: sizes must be at least 1"):
        cuda_graphs.parse_buckets("0,4", 4)


def test_compile_wraps_the_model_once(tiny_loaded: Any) -> None:
    ex = TorchExecutor(tiny_loaded, "cpu", "fp32", compile=True)
    try:
        assert ex.visual._orig_mod is not None  # torch.compile's wrapper, compiled on first use
    finally:
        ex.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_only_backends_say_why_not_here() -> None:
    assert torch_eager.unavailable_reason("torch", "cuda:0") == "not available on cuda:0"
    assert torch_eager.unavailable_reason("torch", "cpu") is None
    assert cuda_graphs.unavailable_reason("cuda-graphs", "cuda:0") == "not available on cuda:0"


@pytest.mark.gpu
@needs_cuda
def test_cuda_layer_pins_staging_and_orders_its_streams() -> None:
    cuda = CudaDevice(torch.device("cuda", 0))
    assert cuda.host_empty((4,), torch.uint8).is_pinned()
    assert cuda.stage(np.zeros(4, np.uint8)).is_pinned()
    copy_stream, compute = cuda.stream(), cuda.stream()
    assert copy_stream != torch.cuda.default_stream(0)
    host = cuda.host_empty((1 << 20,), torch.float32).fill_(3.0)
    device = torch.empty((1 << 20,), device="cuda:0")
    copied, done = cuda.event(), cuda.event(blocking=True)
    with cuda.on(copy_stream):
        device.copy_(host, non_blocking=True)
        copied.record(copy_stream)
    compute.wait_event(copied)
    with cuda.on(compute):
        total = device.sum()
        result = cuda.host_empty((), torch.float32)
        result.copy_(total, non_blocking=True)
        done.record(compute)
    done.synchronize()
    assert result.item() == 3.0 * (1 << 20)
