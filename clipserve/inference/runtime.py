"""The executors: the model loaded once, one warmed-up executor per device and tower, each on
the one thread that runs it (`Runtime`, built by `build_runtime`), and the image decoder.

Each device gets one thread that builds, warms up and later runs its executor; no other thread
ever runs the model. On the CPU this matters: every thread that runs a torch op gets its own
OpenMP team, and once libgomp manages more threads than there are cores it stops spin-waiting,
which made batch-1 inference 30% slower here (bench/results/served_vs_offline-*.json). On
CUDA the thread selects its device before anything else runs on it (`device_thread`), so no
thread ever creates a context on a GPU it does not serve.

`--backend auto` tries its candidates in order and keeps the first that builds and warms up on
every device: a backend that cannot start (no TensorRT libraries, an engine that fails to build)
is logged and skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.thread import BrokenThreadPool
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from clipserve.backends.base import Executor, ExecutorSpec, warmup_sizes
from clipserve.backends.device import (
    is_cpu,
    is_cuda,
    select_device,
    selected_device,
    torch_device_name,
)
from clipserve.backends.registry import (
    backend_candidates,
    create_executor,
    create_text_executor,
    resolve_devices,
)
from clipserve.config import ServerConfig, resolve_device_defaults, resolve_workers
from clipserve.errors import StartupError
from clipserve.inference.model import LoadedModel, load_model
from clipserve.inference.preprocess import ImageDecoder
from clipserve.inference.self_check import run_self_check

if TYPE_CHECKING:  # imports torch: only with --decode gpu
    from clipserve.inference.gpu_decode import BatchDecoder

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    config: ServerConfig  # as served: device-dependent defaults resolved (resolve_device_defaults)
    model: LoadedModel
    backend: str
    executors: list[Executor]
    text_executors: list[Executor]  # one per device, on the same thread as executors[i]
    threads: list[ThreadPoolExecutor]  # threads[i] is the only thread that runs device i
    # text_executors[i] run on text_threads[i]: threads[i] on the CPU, a thread of its own on CUDA
    text_threads: list[ThreadPoolExecutor]
    decoder: ImageDecoder
    # --decode gpu: one batch decoder per device (built on its thread), and what admission
    # runs in the pool instead of the decoder (header checks; JPEG bytes pass through).
    device_decoders: list[BatchDecoder] = field(default_factory=list)
    image_input: Callable[[bytes], np.ndarray] | None = None
    # (batch size, seconds) timed after each image executor's warm-up: its worker's cost model
    # starts from these, so admission is calibrated from the first request (not after a cold
    # guess refused requests the devices could have served).
    warm_costs: list[list[tuple[int, float]]] = field(default_factory=list)
    text_warm_costs: list[list[tuple[int, float]]] = field(default_factory=list)
    spec: ExecutorSpec | None = None  # what the image executors were built from
    self_check: dict[str, Any] | None = None  # inference/self_check.py: what /info shows

    def tokenize(
        self, texts: list[str], *, truncate: bool = True, positions: Sequence[int] | None = None
    ) -> np.ndarray:
        """CPU work: run it in the decode pool (see LoadedModel.tokenize)."""
        return self.model.tokenize(texts, truncate=truncate, positions=positions)

    @property
    def devices(self) -> list[str]:
        return [ex.info.device for ex in self.executors]

    @property
    def precision(self) -> str:
        return self.executors[0].info.precision

    @property
    def on_cpu(self) -> bool:
        return all(is_cpu(ex.info.device) for ex in self.executors)

    def decode_workers(self, requested: int) -> int:
        """0 = auto: one per core when a GPU computes; with CPU inference, one per 8 cores, since
        each decode thread preempts one of torch's (2 threads here: 0.79 of offline, 1: 0.95)."""
        if requested:
            return requested
        cores = resolve_workers(0)
        return max(1, cores // 8) if self.on_cpu else cores

    def close(self) -> None:
        _close(self.executors, self.text_executors, self.threads, self.text_threads, wait=True)
        for decoder in self.device_decoders:  # --decode gpu: a child process each, if several
            decoder.close()


def device_thread(device: str) -> ThreadPoolExecutor:
    """The one thread that builds and runs `device`'s executors; its initialiser selects the
    device (torch.cuda.set_device on CUDA) before any other call can touch CUDA."""
    return ThreadPoolExecutor(
        1, thread_name_prefix=f"clipserve-{device}", initializer=select_device, initargs=(device,)
    )


def _start_thread(thread: ThreadPoolExecutor, device: str) -> None:
    try:
        bound = thread.submit(selected_device).result()
    except BrokenThreadPool:  # the initialiser raised; concurrent.futures logged the traceback
        raise StartupError(f"--gpus: could not select {device} (see the log above)") from None
    assert bound == device


def _close(
    executors: list[Executor],
    text_executors: list[Executor],
    threads: list[ThreadPoolExecutor],
    text_threads: list[ThreadPoolExecutor],
    *,
    wait: bool,
) -> None:
    """Close each executor on the thread it runs on (either list may be short after a failed
    build), then stop the threads, each once."""
    _close_built(executors, threads)
    _close_built(text_executors, text_threads)
    for thread in {id(t): t for t in (*threads, *text_threads)}.values():
        thread.shutdown(wait=wait)


def text_thread(device: str, image_thread: ThreadPoolExecutor) -> ThreadPoolExecutor:
    """Where the text tower runs. On CUDA, a thread of its own: each device thread blocks until
    its batch's results are back, so a shared one would make text batches wait behind image
    batches. On the CPU, the image thread: a second thread running torch would bring a second
    OpenMP team (see the module docstring)."""
    return device_thread(device) if is_cuda(device) else image_thread


def _close_built(executors: list[Executor], threads: list[ThreadPoolExecutor]) -> None:
    for executor, thread in zip(executors, threads, strict=False):
        thread.submit(executor.close).result()


def _close_quietly(executors: list[Executor], threads: Sequence[ThreadPoolExecutor | None]) -> None:
    """Close what a failed build left; a device that failed may fail to close as well, and the
    error that matters is the build's."""
    for executor, thread in zip(executors, threads, strict=False):
        try:
            if thread is None:  # already on the device thread
                executor.close()
            else:
                thread.submit(executor.close).result()
        except Exception:
            log.debug("closing %s after a failed build failed too", executor.info, exc_info=True)


def _build_executor(model: LoadedModel, spec: ExecutorSpec, device: str) -> Executor:
    executor = create_executor(model, spec, device)
    try:
        sizes = warmup_sizes(spec.max_batch_size)
        t0 = time.perf_counter()
        executor.warmup(sizes)
    except BaseException:
        _close_quietly([executor], [None])
        raise
    took = time.perf_counter() - t0
    what = f"{spec.backend} on {device} ({executor.info.precision})"
    log.info("warmed up %s over batch sizes %s in %.1f s", what, sizes, took)
    return executor


def time_batches(
    executor: Executor, sizes: list[int], context_length: int | None = None
) -> list[tuple[int, float]]:
    """Seconds of one batch of each size, run after the warm-up (which compiled and allocated
    for these sizes): the smallest and the largest give the cost model its line. The same call
    for every backend, on the executor's own thread; `context_length`: a text executor's
    token rows instead of images."""
    height, width = executor.info.input_size
    costs = []
    for n in sorted({sizes[0], sizes[-1]}):
        if context_length is None:
            batch = np.zeros((n, height, width, 3), np.uint8)
        else:
            batch = np.zeros((n, context_length), np.int64)
        t0 = time.perf_counter()
        executor.run(batch)
        costs.append((n, time.perf_counter() - t0))
    return costs


def _build_image_executors(
    model: LoadedModel, spec: ExecutorSpec, devices: list[str], threads: list[ThreadPoolExecutor]
) -> tuple[ExecutorSpec, list[Executor]]:
    """One executor per device, all of one backend: the first candidate for `spec.backend` that
    starts everywhere, returned with the spec it got. With an explicit --backend its failure
    is the startup error; under auto it is one log line and the next candidate is tried."""
    requested = spec.backend
    skipped: list[str] = []
    for backend in backend_candidates(requested, devices[0]):
        chosen = replace(spec, backend=backend)
        executors: list[Executor] = []
        try:
            for device, thread in zip(devices, threads, strict=True):
                executors.append(thread.submit(_build_executor, model, chosen, device).result())
        except Exception as e:
            _close_quietly(executors, threads)
            if requested != "auto":
                raise
            reason = str(e) if isinstance(e, StartupError) else f"{type(e).__name__}: {e}"
            log.warning("--backend auto: %s did not start, trying the next: %s", backend, reason)
            skipped.append(f"{backend}: {reason}")
            continue
        if requested == "auto":
            log.info("--backend auto picked %s for %s", backend, ", ".join(devices))
        return chosen, executors
    raise StartupError(f"--backend auto: no backend started on {devices[0]} ({'; '.join(skipped)})")


def _build_text_executor(model: LoadedModel, spec: ExecutorSpec, device: str) -> Executor:
    """The text tower of the backend the image tower got (`spec.backend`), warmed up."""
    executor = create_text_executor(model, spec, device)
    try:
        executor.warmup(warmup_sizes(spec.max_batch_size))
    except BaseException:
        _close_quietly([executor], [None])
        raise
    return executor


def build_runtime(config: ServerConfig) -> Runtime:
    """Load, build and warm up everything; raises StartupError with a one-line reason."""
    devices = resolve_devices(config.backend.gpus, config.backend.backend)
    config = resolve_device_defaults(config, devices)  # batch and queue sizes for the devices
    threads = [device_thread(d) for d in devices]
    text_threads = [text_thread(d, t) for d, t in zip(devices, threads, strict=True)]
    executors: list[Executor] = []
    text_executors: list[Executor] = []
    try:
        for device, thread, text in zip(devices, threads, text_threads, strict=True):
            _start_thread(thread, device)
            if text is not thread:
                _start_thread(text, device)
        model = threads[0].submit(load_model, config.model).result()
        spec = ExecutorSpec.from_config(config)  # what the executors see of the config
        spec, executors = _build_image_executors(model, spec, devices, threads)
        for device, thread in zip(devices, text_threads, strict=True):
            text_executors.append(thread.submit(_build_text_executor, model, spec, device).result())
    except BaseException:
        _close(executors, text_executors, threads, text_threads, wait=False)
        raise
    decoder = ImageDecoder.from_limits(model.preprocess, config.limits, config.backend.jpeg_scaling)
    runtime = Runtime(
        config, model, spec.backend, executors, text_executors, threads, text_threads, decoder
    )
    sizes = warmup_sizes(spec.max_batch_size)
    for executor, thread in zip(executors, threads, strict=True):
        costs = thread.submit(time_batches, executor, sizes).result()
        runtime.warm_costs.append(costs)
        log.info("%s: batches of %s", executor.info.device, _costs_text(costs))
    context = int(model.context_length)
    for executor, thread in zip(text_executors, text_threads, strict=True):
        costs = thread.submit(time_batches, executor, sizes, context).result()
        runtime.text_warm_costs.append(costs)
        log.info("%s: text batches of %s", executor.info.device, _costs_text(costs))
    if config.backend.decode == "gpu":
        _add_device_decoders(runtime, devices)
    runtime.spec = spec
    runtime.self_check = run_self_check(runtime, config.backend.self_check)
    return runtime


def _costs_text(costs: list[tuple[int, float]]) -> str:
    return ", ".join(f"{n} in {seconds * 1000:.1f} ms" for n, seconds in costs)


def _add_device_decoders(runtime: Runtime, devices: list[str]) -> None:
    """--decode gpu: a batch decoder per device. One device's decodes in this process, made on
    the device's own thread; with several, each decodes in a process of its own (nvJPEG serves
    one device per process: inference/decode_process.py). Simulated devices decode on the CPU,
    with the same code."""
    from clipserve.inference.decode_process import DecodeProcess
    from clipserve.inference.gpu_decode import DeviceDecoder, EncodedAtAdmission

    spec, limits = runtime.model.preprocess, runtime.config.limits
    if len(devices) == 1:
        decoder = runtime.threads[0].submit(
            DeviceDecoder, runtime.decoder, torch_device_name(devices[0])
        )
        runtime.device_decoders.append(decoder.result())
    else:  # started together: each child imports torch and makes its device's context
        children = [DecodeProcess(spec, limits, torch_device_name(d)) for d in devices]
        try:
            for child in children:
                child.wait_ready()
        except BaseException:
            for child in children:
                child.close()
            raise
        runtime.device_decoders.extend(children)
    runtime.image_input = EncodedAtAdmission(runtime.decoder)
    apart = " (a decode process each)" if len(devices) > 1 else ""
    log.info("--decode gpu: JPEGs decode in batches on %s%s", ", ".join(devices), apart)
