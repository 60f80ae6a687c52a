"""The device layer under the torch executors: streams, events, staging memory and graphs.

The executors call only this layer, never `torch.cuda` directly, so the CPU runs the very lines a
GPU runs: the staging-slot ring, launch/wait and graph-bucket replay. Two real implementations:

- `CudaDevice`: CUDA streams and events, pinned host staging (so host-to-device copies are
  truly asynchronous), `torch.cuda.graph` capture and replay.
- `CpuDevice`: what the CPU really has. Every kernel is done when its call returns, so a stream
  is the calling thread itself (waiting on it, or on an event recorded on it, returns at once),
  host memory is device memory (plain buffers: pinning would only cost), and a graph is its
  function replayed eagerly into the static output captured with it.

Memory used across streams (the slots' device buffers, a graph's static input) is only freed
after the host has synchronised with the last event of the work that used it: the caching
allocator reuses a block in its allocating stream's order only (see `Tensor.record_stream`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE


class Event(Protocol):
    """A point in a stream's work (`torch.cuda.Event`)."""

    def record(self, stream: Stream) -> None: ...

    def synchronize(self) -> None: ...


class Stream(Protocol):
    """An ordered queue of device work (`torch.cuda.Stream`)."""

    def wait_event(self, event: Event) -> None: ...

    def wait_stream(self, stream: Stream) -> None: ...

    def synchronize(self) -> None: ...


class Graph(Protocol):
    """Captured work that `replay` runs again, writing its static output in place."""

    def replay(self) -> None: ...


class DeviceLayer(Protocol):
    device: torch.device
    asynchronous: bool  # true where launched work runs on while the host goes on

    def stream(self) -> Stream:
        """A stream of this executor's own."""
        ...

    def event(self, *, blocking: bool = False) -> Event:
        """`blocking`: a host waiting on it sleeps rather than spins."""
        ...

    def on(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        """Makes `stream` current: the work enqueued inside runs on it."""
        ...

    def current(self) -> Stream:
        """The calling thread's current stream (where work enqueued now runs)."""
        ...

    def keep(self, tensor: torch.Tensor, stream: Stream) -> None:
        """`tensor`'s memory is read by work queued on `stream`: the allocator may not reuse it,
        once freed, before that work is done (`Tensor.record_stream`)."""
        ...

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host staging memory that copies to and from the device asynchronously."""
        ...

    def stage(self, batch: np.ndarray) -> torch.Tensor:
        """A host batch as a tensor that copies to the device asynchronously (`copy_` or `.to`
        with non_blocking, on the current stream)."""
        ...

    def download(self, x: torch.Tensor) -> np.ndarray:
        """Device rows back on the host in memory of their own (never a buffer that later work
        rewrites), once the current stream's work is done."""
        ...

    def graph_pool(self) -> _POOL_HANDLE | None:
        """A memory pool that graphs captured one after another share."""
        ...

    def capture(
        self, fn: Callable[[], torch.Tensor], pool: _POOL_HANDLE | None, stream: Stream
    ) -> tuple[Graph, torch.Tensor]:
        """`fn`'s work as a graph, and the static output each replay rewrites."""
        ...

    def memory(self) -> int | None:
        """Device bytes in use, where known."""
        ...

    def release_cache(self) -> None:
        """Give cached device memory back to the driver."""
        ...


def _as_tensor(batch: np.ndarray) -> torch.Tensor:
    # torch cannot wrap read-only memory (e.g. an array straight from PIL).
    return torch.from_numpy(np.ascontiguousarray(batch) if batch.flags.writeable else batch.copy())


class CudaDevice:
    """A CUDA device: the executor's work is asynchronous to the host."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self) -> Stream:
        # A new stream, not one of PyTorch's pool streams: those do not synchronise with the
        # default stream, on which libraries may still queue work.
        return cast(Stream, torch.cuda.Stream(self.device))  # type: ignore[no-untyped-call]

    def event(self, *, blocking: bool = False) -> Event:
        return cast(Event, torch.cuda.Event(blocking=blocking))  # type: ignore[no-untyped-call]

    def on(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(cast(torch.cuda.Stream, stream))

    def current(self) -> Stream:
        return cast(Stream, torch.cuda.current_stream(self.device))

    def keep(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(cast(torch.cuda.Stream, stream))

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Pinned: a copy from pageable memory is staged and synchronous whatever non_blocking says.
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def stage(self, batch: np.ndarray) -> torch.Tensor:
        # Pinned, so the copy is asynchronous. The caller may drop it as soon as the copy is
        # enqueued: PyTorch's host allocator records an event on the copy's stream and reuses
        # the block only after it.
        return _as_tensor(batch).pin_memory()

    def download(self, x: torch.Tensor) -> np.ndarray:
        out: np.ndarray = x.cpu().numpy()  # a blocking copy: waits for the current stream
        return out

    def graph_pool(self) -> _POOL_HANDLE | None:
        return torch.cuda.graph_pool_handle()

    def capture(
        self, fn: Callable[[], torch.Tensor], pool: _POOL_HANDLE | None, stream: Stream
    ) -> tuple[Graph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # The same stream for every capture that shares `pool` (torch.cuda.graph's docs), and
        # the one the warm-up ran on, so libraries' handles exist before capture begins.
        with torch.cuda.graph(graph, pool=pool, stream=cast(torch.cuda.Stream, stream)):
            static_out = fn()
        return graph, static_out

    def memory(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device))

    def release_cache(self) -> None:
        torch.cuda.empty_cache()


class CpuStream:
    """The CPU's one "stream": the calling thread, done with its work when a call returns."""

    def wait_event(self, event: Event) -> None:
        pass  # what the event marks happened before this call could run

    def wait_stream(self, stream: Stream) -> None:
        pass  # every other stream's work is done too: it is this same thread's

    def synchronize(self) -> None:
        pass


class CpuEvent:
    """Marks a point in a CPU stream, which the host has always already passed."""

    def __init__(self) -> None:
        self.recorded = 0  # how often: tests check that the GPU's record calls are made

    def record(self, stream: Stream) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        pass


class EagerGraph:
    """A CPU "graph": `fn` run again on each replay, its result written into the static output
    that capture returned, so callers see a CUDA graph's semantics (the output is overwritten
    by the next replay; the input is read from the static buffer at replay time)."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn()
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self.fn())
        self.replays += 1


class CpuDevice:
    """The host: synchronous, so streams and events have nothing to wait for."""

    asynchronous = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def stream(self) -> Stream:
        return CpuStream()

    def event(self, *, blocking: bool = False) -> Event:
        return CpuEvent()

    def on(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def current(self) -> Stream:
        return CpuStream()

    def keep(self, tensor: torch.Tensor, stream: Stream) -> None:
        pass  # its readers ran before this call returned

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def stage(self, batch: np.ndarray) -> torch.Tensor:
        return _as_tensor(batch)

    def download(self, x: torch.Tensor) -> np.ndarray:
        # A copy: `x` may be a static buffer (a graph's output) that the next replay rewrites.
        out: np.ndarray = x.numpy().copy()
        return out

    def graph_pool(self) -> _POOL_HANDLE | None:
        return None

    def capture(
        self, fn: Callable[[], torch.Tensor], pool: _POOL_HANDLE | None, stream: Stream
    ) -> tuple[Graph, torch.Tensor]:
        graph = EagerGraph(fn)
        return graph, graph.output

    def memory(self) -> int | None:
        return None  # the process's memory, which /metrics reports already

    def release_cache(self) -> None:
        pass


def device_layer(device: torch.device) -> DeviceLayer:
    """The layer for a torch device: CUDA's or the CPU's."""
    if device.type == "cuda":
        return CudaDevice(device)
    if device.type == "cpu":
        return CpuDevice()
    raise ValueError(f"no device layer for {device}")
