"""PyTorch eager executor: FP32 anywhere, FP16 on CUDA; normalises uint8 input on its device.

It is also asynchronous on CUDA (`launch`/`wait`, see `AsyncExecutor`) for the pipelined
worker: a batch is stacked straight into a (pinned) staging slot, copied to the device on a copy
stream while the batch before it computes, normalised, run and L2-normalised on the compute
stream, copied back into staging memory, and its completion is an event. Slots are reused only
once their batch has been waited for, and `wait` copies the rows out, so nothing a later batch
writes is ever handed to a caller. `run` stays the synchronous path (the CPU's worker, and the
bisection of a failed batch).

Streams, events, staging memory and transfers go through the device layer (`torch_device`), so
on the CPU the same lines run with the CPU's own synchronous stream: the CPU tests drive the
slot ring and launch/wait exactly as a GPU does. The CPU's worker still calls `run` only
(`asynchronous` is false: nothing there would overlap).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clipserve.backends.base import (
    ExecutorInfo,
    ExecutorSpec,
    check_batch,
    check_pixels,
    l2_normalise_rows,
    normalisation_affine,
)
from clipserve.backends.device import (
    device_context,
    fatal_device_errors,
    indexed_torch_device,
    is_cpu,
    is_cuda,
)
from clipserve.backends.stacking import stack_into
from clipserve.backends.torch_device import DeviceLayer, Event, Stream, device_layer
from clipserve.config import resolve_workers
from clipserve.errors import StartupError

if TYPE_CHECKING:
    from clipserve.inference.model import LoadedModel


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def unavailable_reason(backend: str, device: str) -> str | None:
    if is_cpu(device) or (is_cuda(device) and torch.cuda.is_available()):
        return None
    return f"not available on {device}"


def default_precision(device: str) -> str:
    return "fp16" if is_cuda(device) else "fp32"


def check_precision(backend: str, precision: str, device: str) -> None:
    if precision == "fp16" and not is_cuda(device):
        raise StartupError(
            f"--precision fp16: backend {backend} supports fp16 only on CUDA devices "
            f"(device is {device}); pass --precision fp32"
        )


def l2_normalise_device(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows where `mask` is true scaled to unit length, in float32 on x's device. Each row is
    divided by its largest magnitude first, so the squares cannot overflow (3e38 normalises to
    unit length, as the host's float64 path does); a row holding NaN or infinity comes out
    non-finite, so the worker still refuses it."""
    x = x.float()
    peak = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    unit = x / peak
    norms = torch.linalg.vector_norm(unit, dim=1, keepdim=True).clamp_min(1e-12)
    return torch.where(mask[:, None], unit / norms, x)


def own_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of this executor's own (PyTorch's pool streams do not synchronise with the
    default stream); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


class _Slot:
    """One batch's staging: host input and mask, their device copies, host output."""

    def __init__(self, n: int, size: tuple[int, int], dim: int, layer: DeviceLayer) -> None:
        h, w = size
        self.host_in = layer.host_empty((n, h, w, 3), torch.uint8)
        self.host_mask = layer.host_empty((n,), torch.bool)
        self.host_out = layer.host_empty((n, dim), torch.float32)
        self.device_in = torch.empty((n, h, w, 3), dtype=torch.uint8, device=layer.device)
        self.device_mask = torch.empty((n,), dtype=torch.bool, device=layer.device)
        self.copied: Event = layer.event()
        # A blocking event: the waiting thread sleeps instead of spinning a core the decode
        # pool could use; it costs tens of microseconds per batch.
        self.done: Event = layer.event(blocking=True)
        self.capacity = n


@dataclass
class _Launched:
    slot: _Slot | None  # None: computed synchronously (float input, or larger than the slots)
    n: int
    rows: np.ndarray | None = None


def configure_cpu_threads(requested: int) -> int:
    """Intra-op threads are process-wide in PyTorch; set them once from --threads."""
    threads = resolve_workers(requested)
    torch.set_num_threads(threads)
    return threads


class TorchExecutor:
    def __init__(
        self,
        model: LoadedModel,
        device: str,
        precision: str,
        *,
        backend: str = "torch",
        compile: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.layer = device_layer(self.device)
        self.dtype = _DTYPES[precision]
        self.spec = model.preprocess
        with device_context(device):
            self.visual: Any = copy.deepcopy(model.module.visual).to(self.device, self.dtype)
            self.visual.eval()
            scale, bias = normalisation_affine(self.spec)
            self._scale = torch.from_numpy(scale).view(1, 3, 1, 1).to(self.device)
            self._bias = torch.from_numpy(bias).view(1, 3, 1, 1).to(self.device)
            # Image batches never queue behind the text tower or a library's default-stream work.
            self.stream: Stream = self.layer.stream()
            # Host-to-device copies of the next batch overlap this batch's compute.
            self.copy_stream: Stream = self.layer.stream()
            # The weights and constants above were copied on the current stream; work on ours
            # reads them. Copies from pageable memory return once done, but the order is now
            # explicit (PyTorch's stream sanitizer, on the first GPU run, flagged `_bias`).
            for stream in (self.stream, self.copy_stream):
                stream.wait_stream(self.layer.current())
        self.asynchronous = self.layer.asynchronous
        self._free: list[_Slot] = []  # staging slots not holding a batch in flight
        self._slots_lock = threading.Lock()  # launch and wait run on different threads
        self._slot_size = 1  # images per slot: the largest warm-up batch
        if compile:  # shapes vary with the batch size: compile for dynamic batch once
            self.visual = torch.compile(self.visual, dynamic=True)
        self.info = ExecutorInfo(
            backend, str(self.device), precision, self.spec.size, model.embed_dim
        )
        self.pixel_device = indexed_torch_device(device)  # where GPU decode's crops must be

    def _to_device(self, batch: np.ndarray) -> torch.Tensor:
        x = self.layer.stage(batch).to(self.device, non_blocking=True)  # on the current stream
        return self.normalise(x) if batch.dtype == np.uint8 else x.to(self.dtype)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC on the device → normalised NCHW in the model's dtype. The permuted view
        keeps channels-last strides, the layout the patch-embedding convolution prefers."""
        return x.permute(0, 3, 1, 2).float().mul_(self._scale).add_(self._bias).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.visual(x)  # open_clip is untyped
        return out

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC already on the device → float32 (N, D) embeddings, on the current stream.
        The result must be memory of its own until the stream moves on (cuda-graphs copies
        out of its static output)."""
        return self.forward(self.normalise(x)).float()

    def launch(self, arrays: Sequence[np.ndarray], normalize: np.ndarray) -> object:
        n = len(arrays)
        if arrays[0].dtype != np.uint8 or n > self._slot_size:
            batch = np.stack(arrays)  # a rare path: synchronous, normalised on the host
            return _Launched(None, n, l2_normalise_rows(self.run(batch), normalize))
        check_batch(arrays[0][None], self.spec)
        return self._launch(n, lambda slot: self._enqueue(slot, arrays, normalize))

    def launch_pixels(self, pixels: torch.Tensor, normalize: np.ndarray) -> object:
        """`launch` for crops already on this device (GPU decode's): no staging copy at all;
        the forward pass reads `pixels` on the compute stream once the work queued on the
        current stream (the decode) is done."""
        n = check_pixels(pixels, self.spec, self.pixel_device)
        if n > self._slot_size:
            return _Launched(None, n, l2_normalise_rows(self.run_pixels(pixels), normalize))
        return self._launch(n, lambda slot: self._enqueue_pixels(slot, pixels, normalize))

    def _launch(self, n: int, enqueue: Callable[[_Slot], None]) -> _Launched:
        with (
            fatal_device_errors(self.info.device),
            device_context(self.info.device),
            torch.inference_mode(),
        ):
            slot = self._take_slot()
            try:
                enqueue(slot)
            except BaseException:
                self._recycle(slot)
                raise
        return _Launched(slot, n)

    def _recycle(self, slot: _Slot) -> None:
        """After a failed launch (out of memory, say): the slot is free once whatever was
        enqueued before the failure is over; on a broken device it is dropped."""
        try:
            self.copy_stream.synchronize()
            self.stream.synchronize()
        except Exception:
            return
        self._give_back(slot)

    def _enqueue(self, slot: _Slot, arrays: Sequence[np.ndarray], normalize: np.ndarray) -> None:
        n = len(arrays)
        stack_into(arrays, slot.host_in.numpy())  # straight into staging memory
        self._copy_in(slot, n, normalize, with_pixels=True)
        self._compute(slot, slot.device_in[:n])

    def _enqueue_pixels(self, slot: _Slot, pixels: torch.Tensor, normalize: np.ndarray) -> None:
        self._copy_in(slot, pixels.shape[0], normalize, with_pixels=False)
        # The decode that wrote `pixels` was queued on the current stream; once freed, their
        # memory must wait for the compute stream's reads too.
        self.stream.wait_stream(self.layer.current())
        self.layer.keep(pixels, self.stream)
        self._compute(slot, pixels)

    def _copy_in(self, slot: _Slot, n: int, normalize: np.ndarray, *, with_pixels: bool) -> None:
        slot.host_mask.numpy()[:n] = normalize
        with self.layer.on(self.copy_stream):
            # The slot's previous batch was waited for before it came back; this keeps its
            # device buffers safe even so, in stream order, at no host cost.
            self.copy_stream.wait_event(slot.done)
            if with_pixels:
                slot.device_in[:n].copy_(slot.host_in[:n], non_blocking=True)
            slot.device_mask[:n].copy_(slot.host_mask[:n], non_blocking=True)
            slot.copied.record(self.copy_stream)

    def _compute(self, slot: _Slot, x: torch.Tensor) -> None:
        """The forward pass of `x` (uint8 NHWC on the device) on the compute stream, after the
        slot's copies; its L2-normalised rows into the slot's host output."""
        n = x.shape[0]
        self.stream.wait_event(slot.copied)
        with self.layer.on(self.stream):
            rows = l2_normalise_device(self.embed(x), slot.device_mask[:n])
            slot.host_out[:n].copy_(rows, non_blocking=True)
            slot.done.record(self.stream)

    def wait(self, launched: object) -> np.ndarray:
        assert isinstance(launched, _Launched)
        if launched.slot is None:
            assert launched.rows is not None
            return launched.rows
        slot = launched.slot
        try:
            with fatal_device_errors(self.info.device):
                slot.done.synchronize()
            # A copy: the slot's output is rewritten by the next batch that uses it.
            return slot.host_out[: launched.n].numpy().copy()
        finally:
            self._give_back(slot)

    def _take_slot(self) -> _Slot:
        """A free slot, or a new one: the ring grows to the number of batches in flight."""
        with self._slots_lock:
            if self._free:
                return self._free.pop()
        return self._new_slot(self._slot_size)

    def _new_slot(self, n: int) -> _Slot:
        # Its device buffers come from the copy stream's pool, the stream that first writes
        # them: a block from another stream's pool may still be in use there (PyTorch's stream
        # sanitizer flagged the default stream's, on the second GPU run).
        with self.layer.on(self.copy_stream):
            return _Slot(n, self.spec.size, self.info.embed_dim, self.layer)

    def _give_back(self, slot: _Slot) -> None:
        with self._slots_lock:
            if slot.capacity == self._slot_size:  # else made before the ring was resized
                self._free.append(slot)

    def run(self, batch: np.ndarray) -> np.ndarray:
        check_batch(batch, self.spec)
        # A fatal CUDA error (illegal address, ECC, device lost) leaves the context unusable:
        # ExecutorFatal stops this worker. Out-of-memory passes through: the batch is split.
        with (
            fatal_device_errors(self.info.device),
            device_context(self.info.device),
            torch.inference_mode(),
            self.layer.on(self.stream),
        ):
            return self.layer.download(self.forward(self._to_device(batch)).float())

    def run_pixels(self, pixels: torch.Tensor) -> np.ndarray:
        """`run` for crops already on this device: read after the work queued on the current
        stream (the decode that wrote them); the rows are on the host when this returns."""
        check_pixels(pixels, self.spec, self.pixel_device)
        with (
            fatal_device_errors(self.info.device),
            device_context(self.info.device),
            torch.inference_mode(),
        ):
            self.stream.wait_stream(self.layer.current())
            with self.layer.on(self.stream):
                return self.layer.download(self.embed(pixels))

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        h, w = self.spec.size
        for n in batch_sizes:
            self.run(np.zeros((n, h, w, 3), dtype=np.uint8))
        self.prepare_staging(max(batch_sizes))

    def prepare_staging(self, max_batch_size: int, slots: int = 2) -> None:
        """Staging for batches up to `max_batch_size`, two slots made now (pinning is slow: not
        on the request path) and, where the worker will launch, one launch through them to
        warm the kernels."""
        self._slot_size = max_batch_size
        with device_context(self.info.device):
            made = [self._new_slot(max_batch_size) for _ in range(slots)]
        with self._slots_lock:
            self._free = made
        if not self.asynchronous:  # the worker calls run() only
            return
        h, w = self.spec.size
        sample = [np.zeros((h, w, 3), dtype=np.uint8)] * max_batch_size
        self.wait(self.launch(sample, np.ones(max_batch_size, dtype=bool)))

    def memory(self) -> int | None:
        return self.layer.memory()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # batches in flight still use the slots' memory
            self.copy_stream.synchronize()
            self.stream.synchronize()
        del self.visual
        with self._slots_lock:
            self._free = []
        with device_context(self.info.device):
            self.layer.release_cache()


def create(model: LoadedModel, spec: ExecutorSpec, device: str) -> TorchExecutor:
    precision = spec.precision or default_precision(device)
    check_precision("torch", precision, device)
    if is_cpu(device):
        configure_cpu_threads(spec.threads)
    return TorchExecutor(model, device, precision, compile=spec.compile)
