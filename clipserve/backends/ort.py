"""ONNX Runtime executors: ort-cpu, ort-cuda, ort-trt (TensorRT EP).

One class for all three. Inputs and outputs are bound by pointer into buffers preallocated on
the executor's device at the largest batch size, so every batch size reuses them and nothing
crosses to the host but the input and output copies. The same binding code runs on the CPU,
where the tests exercise it.

onnxruntime-gpu lists the CUDA and TensorRT providers even where they cannot load, and a session
asked for them silently falls back to the CPU: the providers a session actually got are checked,
and a GPU backend that did not get its provider refuses to start.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clipserve.backends.base import ExecutorInfo, check_batch
from clipserve.backends.onnx_export import (
    INPUT,
    OUTPUT,
    PIXELS,
    ExportedModel,
    cached_export,
    session_options,
)
from clipserve.config import resolve_workers
from clipserve.errors import StartupError

if TYPE_CHECKING:
    from clipserve.config import ServerConfig
    from clipserve.model import LoadedModel

log = logging.getLogger(__name__)

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
PROVIDER = {"ort-cpu": CPU, "ort-cuda": CUDA, "ort-trt": TRT}
INSTALL_HINT = {
    "ort-cpu": "pip install onnxruntime",
    "ort-cuda": "pip install 'clipserve[cuda]' (onnxruntime-gpu's CUDA 13 and cuDNN libraries)",
    "ort-trt": "pip install 'clipserve[tensorrt]' (TensorRT libraries for onnxruntime-gpu)",
}
DEFAULT_PRECISION = {"ort-cpu": "fp32", "ort-cuda": "fp16", "ort-trt": "fp16"}
SUPPORTED_PRECISIONS = {
    "ort-cpu": ("fp32",),
    "ort-cuda": ("fp16", "fp32"),
    "ort-trt": ("fp16", "fp32"),
}
TRT_WORKSPACE_BYTES = 4 << 30


def device_id(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def shape_spec(name: str, batch: int, height: int, width: int) -> str:
    """TensorRT EP profile syntax: 'input:NxCxHxW'."""
    return f"{name}:{batch}x3x{height}x{width}"


def cuda_provider_options(device: str) -> dict[str, str]:
    return {
        "device_id": str(device_id(device)),
        # Grow the arena by what is asked, not powers of two: a server's shapes are bounded.
        "arena_extend_strategy": "kSameAsRequested",
        "cudnn_conv_algo_search": "EXHAUSTIVE",
        "do_copy_in_default_stream": "1",
    }


def trt_provider_options(
    device: str, cache: Path, size: tuple[int, int], max_batch: int, precision: str
) -> dict[str, str]:
    """Explicit min/opt/max profile, so one engine serves every batch size from 1 to max_batch
    (without it the EP rebuilds whenever a batch exceeds the shapes seen so far); engines and
    the timing cache persist in `cache`. opt is the largest batch: where throughput matters."""
    h, w = size
    return {
        "device_id": str(device_id(device)),
        "trt_fp16_enable": "True" if precision == "fp16" else "False",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache),
        "trt_max_workspace_size": str(TRT_WORKSPACE_BYTES),
        "trt_profile_min_shapes": shape_spec(INPUT, 1, h, w),
        "trt_profile_opt_shapes": shape_spec(INPUT, max_batch, h, w),
        "trt_profile_max_shapes": shape_spec(INPUT, max_batch, h, w),
    }


def providers_for(
    backend: str, device: str, cache: Path, size: tuple[int, int], max_batch: int, precision: str
) -> list[tuple[str, dict[str, str]]]:
    """The provider list for a session: the wanted provider first, then its fallbacks for nodes
    it cannot run (TensorRT → CUDA → CPU). Whether the wanted one loaded is checked after."""
    if backend == "ort-cpu":
        return [(CPU, {})]
    cuda = (CUDA, cuda_provider_options(device))
    if backend == "ort-cuda":
        return [cuda, (CPU, {})]
    trt = (TRT, trt_provider_options(device, cache, size, max_batch, precision))
    return [trt, cuda, (CPU, {})]


def check_providers(backend: str, device: str, got: Sequence[str]) -> None:
    wanted = PROVIDER[backend]
    if wanted not in got:
        raise StartupError(
            f"--backend {backend}: ONNX Runtime could not use {wanted} on {device} (the session "
            f"got {', '.join(got)}); {INSTALL_HINT[backend]}"
        )


def tensorrt_libraries_present() -> bool:
    return (
        importlib.util.find_spec("tensorrt_libs") is not None
        or importlib.util.find_spec("tensorrt") is not None
        or ctypes.util.find_library("nvinfer") is not None
    )


def _available(backend: str, device: str) -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    if PROVIDER[backend] not in ort.get_available_providers():
        return False
    if backend == "ort-cpu":
        return device == "cpu"
    if not device.startswith("cuda"):
        return False
    return backend != "ort-trt" or tensorrt_libraries_present()


class OrtExecutor:
    def __init__(
        self,
        exported: ExportedModel,
        model: LoadedModel,
        backend: str,
        device: str,
        precision: str,
        *,
        max_batch_size: int,
        threads: int,
        enable_profiling: bool = False,
    ) -> None:
        import onnxruntime as ort

        self.ort = ort
        self.spec = model.preprocess
        self.backend = backend
        self.device_type = "cpu" if device == "cpu" else "cuda"
        self.device_id = device_id(device)
        if self.device_type == "cuda" and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels that PyTorch also uses
        options = session_options(exported.precision, threads)
        if enable_profiling:
            options.enable_profiling = True
            options.profile_file_prefix = str(exported.directory / f"profile-{backend}")
        trt_cache = exported.directory / "trt"
        trt_cache.mkdir(exist_ok=True)
        providers = providers_for(
            backend, device, trt_cache, self.spec.size, max_batch_size, precision
        )
        t0 = time.perf_counter()
        self.image = ort.InferenceSession(str(exported.image), options, providers=providers)
        check_providers(backend, device, self.image.get_providers())
        # The normalisation prefix is tiny: CUDA (or CPU) is enough, TensorRT would add a build.
        prefix_providers = [p for p in providers if p[0] != TRT]
        self.normalize = ort.InferenceSession(str(exported.normalize), options,
                                              providers=prefix_providers)  # fmt: skip
        log.info("%s session on %s ready in %.1f s (providers: %s)", backend, device,
                 time.perf_counter() - t0, ", ".join(self.image.get_providers()))  # fmt: skip
        self.float_dtype = np.float16 if exported.precision == "fp16" else np.float32
        h, w = self.spec.size
        self.max_batch = max_batch_size
        self._x = ort.OrtValue.ortvalue_from_shape_and_type(
            (max_batch_size, 3, h, w), self.float_dtype, self.device_type, self.device_id
        )
        self._y = ort.OrtValue.ortvalue_from_shape_and_type(
            (max_batch_size, model.embed_dim), self.float_dtype, self.device_type, self.device_id
        )
        self.info = ExecutorInfo(backend, device, precision, self.spec.size, model.embed_dim)

    def _bind(self, binding: Any, name: str, value: Any, shape: tuple[int, ...], out: bool) -> None:
        bind = binding.bind_output if out else binding.bind_input
        bind(name, self.device_type, self.device_id, self.float_dtype, list(shape),
             value.data_ptr())  # fmt: skip

    def run(self, batch: np.ndarray) -> np.ndarray:
        check_batch(batch, self.spec)
        n = batch.shape[0]
        if n > self.max_batch:
            raise ValueError(f"batch of {n} exceeds the preallocated {self.max_batch}")
        h, w = self.spec.size
        x_shape = (n, 3, h, w)
        image = self.image.io_binding()
        if batch.dtype == np.uint8:
            prefix = self.normalize.io_binding()
            prefix.bind_cpu_input(PIXELS, np.ascontiguousarray(batch))  # the one input copy
            self._bind(prefix, INPUT, self._x, x_shape, out=True)
            self.normalize.run_with_iobinding(prefix)
            self._bind(image, INPUT, self._x, x_shape, out=False)
        else:
            image.bind_cpu_input(INPUT, np.ascontiguousarray(batch, dtype=self.float_dtype))
        self._bind(image, OUTPUT, self._y, (n, self.info.embed_dim), out=True)
        self.image.run_with_iobinding(image)
        out: np.ndarray = image.copy_outputs_to_cpu()[0]  # the one output copy
        return out.astype(np.float32, copy=False)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        h, w = self.spec.size
        t0 = time.perf_counter()
        self.run(np.zeros((max(batch_sizes), h, w, 3), dtype=np.uint8))
        if self.backend == "ort-trt":  # the engine is built (or loaded from cache) on first run
            log.info("TensorRT engine ready in %.1f s", time.perf_counter() - t0)
        for n in batch_sizes:
            self.run(np.zeros((n, h, w, 3), dtype=np.uint8))

    def memory(self) -> int | None:
        if self.device_type != "cuda":
            return None
        import torch

        free, total = torch.cuda.mem_get_info(self.device_id)
        return int(total - free)  # device-wide: ORT does not report its arena from Python

    def end_profiling(self) -> str:
        return str(self.image.end_profiling())

    def close(self) -> None:
        del self.image, self.normalize, self._x, self._y


def create_ort(
    backend: str, model: LoadedModel, config: ServerConfig, device: str, *, profiling: bool = False
) -> OrtExecutor:
    precision = config.backend.precision or DEFAULT_PRECISION[backend]
    if precision not in SUPPORTED_PRECISIONS[backend]:
        raise StartupError(
            f"--precision {precision}: backend {backend} supports "
            f"{', '.join(SUPPORTED_PRECISIONS[backend])}"
        )
    if backend != "ort-cpu" and not device.startswith("cuda"):
        raise StartupError(f"--backend {backend} needs a CUDA device; --gpus resolved to {device}")
    # TensorRT takes the FP32 graph and builds FP16 kernels itself (trt_fp16_enable).
    graph_precision = "fp32" if backend == "ort-trt" else precision
    exported = cached_export(model, Path(config.model.cache_dir), graph_precision)
    threads = resolve_workers(config.backend.threads) if device == "cpu" else 1
    return OrtExecutor(exported, model, backend, device, precision, threads=threads,
                       max_batch_size=config.batching.max_batch_size,
                       enable_profiling=profiling)  # fmt: skip


def create_cpu(model: LoadedModel, config: ServerConfig, device: str) -> OrtExecutor:
    return create_ort("ort-cpu", model, config, device)


def create_cuda(model: LoadedModel, config: ServerConfig, device: str) -> OrtExecutor:
    return create_ort("ort-cuda", model, config, device)


def create_trt(model: LoadedModel, config: ServerConfig, device: str) -> OrtExecutor:
    return create_ort("ort-trt", model, config, device)


def available_cpu(device: str) -> bool:
    return _available("ort-cpu", device)


def available_cuda(device: str) -> bool:
    return _available("ort-cuda", device)


def available_trt(device: str) -> bool:
    return _available("ort-trt", device)
