"""PyTorch with captured CUDA graphs: one graph per batch-size bucket, captured during warm-up.

A batch is padded to the next bucket, replayed, and the padding sliced off. Every graph
normalises its static uint8 input on the device, so a replay is the whole forward pass with one
launch. Already-normalised float input runs eagerly on the same stream.

Capture and replay go through the device layer (`torch_device`): built on the CPU (by `build`,
as the tests do) a graph is replayed eagerly into the same static buffers, so bucketing, the
static input and output and the pipelined path run here as they do on a GPU. The server itself
refuses a CPU device (`create`): eager replay is slower than `--backend torch`.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from clipserve.backends.base import ExecutorSpec, check_batch, warmup_sizes
from clipserve.backends.device import device_context, fatal_device_errors, is_cuda
from clipserve.backends.torch_eager import TorchExecutor, default_precision
from clipserve.errors import StartupError

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # a graph pool's handle (torch's graphs.py does the same)

    from clipserve.backends.torch_device import Graph
    from clipserve.inference.model import LoadedModel

log = logging.getLogger(__name__)


def unavailable_reason(backend: str, device: str) -> str | None:
    if is_cuda(device) and torch.cuda.is_available():
        return None
    return f"not available on {device}"


def parse_buckets(spec: str, max_batch_size: int) -> list[int]:
    """'' → powers of two up to the largest batch; else the listed sizes, which must cover it."""
    if not spec.strip():
        return warmup_sizes(max_batch_size)
    buckets = sorted({int(s) for s in spec.replace(" ", "").split(",")})
    if buckets[0] < 1:
        raise StartupError("--batch-buckets: sizes must be at least 1")
    if buckets[-1] < max_batch_size:
        raise StartupError(
            f"--batch-buckets: the largest bucket ({buckets[-1]}) must be at least "
            f"--max-batch-size ({max_batch_size})"
        )
    return [b for b in buckets if b < max_batch_size] + [max_batch_size]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"batch of {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class CudaGraphExecutor(TorchExecutor):
    def __init__(
        self, model: LoadedModel, device: str, precision: str, buckets: Sequence[int]
    ) -> None:
        super().__init__(model, device, precision, backend="cuda-graphs")
        self.buckets = list(buckets)
        self._graphs: dict[int, tuple[Graph, torch.Tensor, torch.Tensor]] = {}

    def _capture(self, n: int, pool: _POOL_HANDLE | None) -> None:
        h, w = self.spec.size
        with torch.inference_mode(), self.layer.on(self.stream):
            # Zeroed on the stream that reads it (the first GPU run's stream sanitizer).
            static_in = torch.zeros((n, h, w, 3), dtype=torch.uint8, device=self.device)
            for _ in range(2):  # warm up kernels and the allocator outside the capture
                self.forward(self.normalise(static_in))
            self.stream.synchronize()
            graph, static_out = self.layer.capture(
                lambda: self.forward(self.normalise(static_in)).float(), pool, self.stream
            )
        self._graphs[n] = (graph, static_in, static_out)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Capture every bucket now, largest first so the smaller ones share its memory pool.
        Inside this device's context: torch.cuda.graph synchronises and empties the cache on the
        *current* device, which on a thread that had not selected one would be GPU 0."""
        t0 = time.perf_counter()
        with fatal_device_errors(self.info.device), device_context(self.info.device):
            pool = self.layer.graph_pool()
            for n in sorted(self.buckets, reverse=True):
                self._capture(n, pool)
        took = time.perf_counter() - t0
        log.info("captured graphs on %s for buckets %s in %.1f s", self.device, self.buckets, took)
        self.prepare_staging(max(self.buckets))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The pipelined path's forward pass: the batch, already on the device, is copied into
        its bucket's static input on the current stream and the graph replayed. The returned
        view lives in the graph's pool, which the next replay overwrites: the caller turns it
        into memory of its own (L2 normalisation writes a new tensor) on the same stream,
        before any later replay can run."""
        n = x.shape[0]
        graph, static_in, static_out = self._graphs[bucket_for(n, self.buckets)]
        static_in[:n].copy_(x)
        graph.replay()
        return static_out[:n]

    def run(self, batch: np.ndarray) -> np.ndarray:
        if batch.dtype != np.uint8:
            return super().run(batch)
        check_batch(batch, self.spec)
        n = batch.shape[0]
        graph, static_in, static_out = self._graphs[bucket_for(n, self.buckets)]
        with (
            fatal_device_errors(self.info.device),  # e.g. an illegal address during replay
            device_context(self.info.device),
            torch.inference_mode(),
            self.layer.on(self.stream),
        ):
            static_in[:n].copy_(self.layer.stage(batch), non_blocking=True)
            graph.replay()
            return self.layer.download(static_out[:n])  # waits for the replay on this stream


def create(model: LoadedModel, spec: ExecutorSpec, device: str) -> CudaGraphExecutor:
    if not is_cuda(device):
        raise StartupError(
            f"--backend cuda-graphs needs a CUDA device; --gpus resolved to {device}"
        )
    return build(model, spec, device)


def build(model: LoadedModel, spec: ExecutorSpec, device: str) -> CudaGraphExecutor:
    """The executor for `spec` on any device the layer knows, the CPU included (the tests')."""
    precision = spec.precision or default_precision(device)
    buckets = parse_buckets(spec.batch_buckets, spec.max_batch_size)
    return CudaGraphExecutor(model, device, precision, buckets)
