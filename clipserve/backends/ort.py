"""ONNX Runtime executors: ort-cpu, ort-cuda, ort-trt (TensorRT EP).

One class for all three. Inputs and outputs are bound by pointer into buffers preallocated on
the executor's device at the largest batch size, so every batch size reuses them and nothing
crosses to the host but the input and output copies. The same binding code runs on the CPU,
where the tests exercise it.

onnxruntime-gpu lists the CUDA and TensorRT providers even where they cannot load, and a session
asked for them silently falls back to the CPU: the providers a session actually got are checked,
and a GPU backend that did not get its provider refuses to start. Providers that are not even
installed are never requested (ONNX Runtime would only warn), so the refusal is one clear error.

TensorRT engines are cached per TensorRT version, GPU compute capability, precision and shape
profile (`TrtCache`): ONNX Runtime names engine files by graph, so two configurations
sharing one directory would load or overwrite each other's engines. ONNX Runtime also writes
them in place: `with_engine_cache` builds into a staging folder, under a lock, then renames it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from clipserve.backends.base import ExecutorInfo, ExecutorSpec, check_batch, check_pixels
from clipserve.backends.device import (
    cuda_index,
    fatal_device_errors,
    indexed_torch_device,
    is_cpu,
    is_cuda,
)
from clipserve.backends.onnx_export import (
    INPUT,
    OUTPUT,
    PIXELS,
    ExportedModel,
    build_once,
    folder_lock,
    import_onnxruntime,
    onnxruntime_warnings_logged,
    open_cached_export,
    session_options,
    unwritable,
)
from clipserve.config import resolve_workers
from clipserve.errors import StartupError

if TYPE_CHECKING:
    import torch

    from clipserve.inference.model import LoadedModel

log = logging.getLogger(__name__)
T = TypeVar("T")

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
# How ONNX Runtime's TensorRT EP says a cached engine or timing cache cannot be read.
TRT_CACHE_ERROR = re.compile(r"could not (deserialize engine from cache|create timing cache)")
# pip distributions that carry TensorRT, newest naming first (their version is TensorRT's).
TRT_DISTRIBUTIONS = (
    "tensorrt-cu13-libs",
    "tensorrt-cu12-libs",
    "tensorrt-cu13",
    "tensorrt-cu12",
    "tensorrt-libs",
    "tensorrt",
)


def device_id(device: str) -> int:
    """ONNX Runtime's device id: the CUDA index, 0 on the CPU."""
    return cuda_index(device) or 0


def shape_spec(name: str, batch: int, height: int, width: int) -> str:
    """TensorRT EP profile syntax: 'input:NxCxHxW'."""
    return f"{name}:{batch}x3x{height}x{width}"


def cuda_provider_options(device: str) -> dict[str, str]:
    return {
        "device_id": str(device_id(device)),
        # Grow the arena by what is asked, not powers of two: a server's shapes are bounded.
        "arena_extend_strategy": "kSameAsRequested",
        # EXHAUSTIVE (ORT's default) benchmarks every cuDNN algorithm the first time it sees an
        # input shape: warm-up covers only some batch sizes, so the others would pay for that
        # search on a user's request. The only convolution in a ViT is the patch embedding.
        "cudnn_conv_algo_search": "HEURISTIC",
        "do_copy_in_default_stream": "1",
    }


def trt_profile(max_batch: int) -> tuple[int, int, int]:
    """Batch sizes of the TensorRT shape profile: min, opt, max. opt is the largest batch:
    where throughput matters."""
    return 1, max_batch, max_batch


def tensorrt_version() -> str:
    """TensorRT's version as installed: from its pip distribution, else from libnvinfer."""
    for dist in TRT_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    lib = ctypes.util.find_library("nvinfer")
    if lib is not None:
        try:
            return f"lib{ctypes.CDLL(lib).getInferLibVersion()}"
        except (OSError, AttributeError):
            pass
    return "unknown"


def compute_capability(device: str) -> tuple[int, int] | None:
    """None where CUDA cannot be reached: the TensorRT session will then be refused anyway."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(cuda_index(device) or 0)
    return int(major), int(minor)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


@dataclass(frozen=True)
class TrtCache:
    """Everything a built TensorRT engine depends on besides the graph (the export's own cache
    key covers the graph): one engine directory per distinct value, so two configurations never
    load or overwrite each other's engines."""

    trt_version: str
    capability: tuple[int, int] | None  # the GPU's compute capability
    precision: str
    size: tuple[int, int]  # (height, width)
    profile: tuple[int, int, int]  # batch sizes: min, opt, max

    @property
    def device_key(self) -> str:
        sm = "".join(map(str, self.capability)) if self.capability else "unknown"
        return f"trt{_safe(self.trt_version)}-sm{sm}"

    @property
    def key(self) -> str:
        (h, w), (lo, opt, hi) = self.size, self.profile
        return f"{self.device_key}-{self.precision}-b{lo}-{opt}-{hi}-{h}x{w}"

    def engine_dir(self, root: Path) -> Path:
        return root / self.key

    def timing_dir(self, root: Path) -> Path:
        """Timing caches depend only on TensorRT and the GPU: shared across precisions and
        profiles, which makes their builds faster."""
        return root / self.device_key


def trt_provider_options(device: str, cache: TrtCache, root: Path) -> dict[str, str]:
    """Explicit min/opt/max profile, so one engine serves every batch size from 1 to the largest
    (without it the EP rebuilds whenever a batch exceeds the shapes seen so far); engines and
    the timing cache persist under `root`, keyed by `cache`."""
    (h, w), (lo, opt, hi) = cache.size, cache.profile
    return {
        "device_id": str(device_id(device)),
        "trt_fp16_enable": "True" if cache.precision == "fp16" else "False",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache.engine_dir(root)),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache.timing_dir(root)),
        "trt_max_workspace_size": str(TRT_WORKSPACE_BYTES),
        "trt_profile_min_shapes": shape_spec(INPUT, lo, h, w),
        "trt_profile_opt_shapes": shape_spec(INPUT, opt, h, w),
        "trt_profile_max_shapes": shape_spec(INPUT, hi, h, w),
    }


def broken_trt_cache(error: BaseException, engines: Path, timing: Path) -> Path | None:
    """The cache folder a session-creation error says ONNX Runtime could not read, if any."""
    found = TRT_CACHE_ERROR.search(str(error))
    if found is None:
        return None
    return timing if "timing" in found.group(1) else engines


def with_engine_cache(engines: Path, timing: Path, build: Callable[[Path], T]) -> T:
    """`build(folder)`: the session, warmed up, with its TensorRT engines cached in `folder`
    (`build_once`: ONNX Runtime writes engine files in place, so a kill mid-build would leave
    half an engine, loaded at every start). A cache that ONNX Runtime cannot read is removed
    and built once more."""
    what = "TensorRT engine"

    def attempt() -> T:
        try:
            timing.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise unwritable(timing.parent, what, e) from None
        return build_once(engines, what, build)

    try:
        return attempt()
    except StartupError:
        raise
    except Exception as e:
        broken = broken_trt_cache(e, engines, timing)
        if broken is None:
            raise
        log.warning("TensorRT cache %s cannot be read (%s); building it again", broken, e)
        with folder_lock(engines, what):
            shutil.rmtree(broken, ignore_errors=True)
    return attempt()


def providers_for(
    backend: str, device: str, trt: dict[str, str] | None = None
) -> list[tuple[str, dict[str, str]]]:
    """The provider list for a session: the wanted provider first, then its fallbacks for nodes
    it cannot run (TensorRT → CUDA → CPU). Whether the wanted one loaded is checked after."""
    if backend == "ort-cpu":
        return [(CPU, {})]
    cuda = (CUDA, cuda_provider_options(device))
    if backend == "ort-cuda":
        return [cuda, (CPU, {})]
    if trt is None:
        raise ValueError("ort-trt needs its TensorRT provider options")
    return [(TRT, trt), cuda, (CPU, {})]


def check_providers(backend: str, device: str, got: Sequence[str], *, installed: bool) -> None:
    wanted = PROVIDER[backend]
    if wanted not in got:
        where = "this onnxruntime build has" if installed else "the session got"
        raise StartupError(
            f"--backend {backend}: ONNX Runtime could not use {wanted} on {device} ({where} "
            f"{', '.join(got)}); {INSTALL_HINT[backend]}"
        )


def tensorrt_libraries_present() -> bool:
    return (
        importlib.util.find_spec("tensorrt_libs") is not None
        or importlib.util.find_spec("tensorrt") is not None
        or ctypes.util.find_library("nvinfer") is not None
    )


def unavailable_reason(backend: str, device: str) -> str | None:
    """Why `backend` cannot run on `device` (None if it may); `--backend auto` logs it."""
    try:
        ort = import_onnxruntime()
    except ImportError as e:
        return f"onnxruntime cannot be imported ({e}); {INSTALL_HINT[backend]}"
    if PROVIDER[backend] not in ort.get_available_providers():
        return f"this onnxruntime build has no {PROVIDER[backend]}; {INSTALL_HINT[backend]}"
    if backend == "ort-cpu":
        return None if is_cpu(device) else "serves on the CPU only"
    if not is_cuda(device):
        return "needs a CUDA device"
    if backend == "ort-trt" and not tensorrt_libraries_present():
        return f"TensorRT libraries not found; {INSTALL_HINT[backend]}"
    return None


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
        ort = import_onnxruntime()
        self.ort = ort
        self.spec = model.preprocess
        self.backend = backend
        self.device = device
        self.on_cuda = is_cuda(device)
        self.device_type = "cuda" if self.on_cuda else "cpu"  # as ONNX Runtime names it
        self.device_id = device_id(device)
        self.float_dtype = np.float16 if exported.precision == "fp16" else np.float32
        self.max_batch = max_batch_size
        self.info = ExecutorInfo(backend, device, precision, self.spec.size, model.embed_dim)
        # GPU decode's crops on this device are bound as they are (`run_pixels`).
        self.pixel_device = indexed_torch_device(device)
        trt: dict[str, str] | None = None
        if backend == "ort-trt":
            cache = TrtCache(
                trt_version=tensorrt_version(),
                capability=compute_capability(device),
                precision=precision,
                size=self.spec.size,
                profile=trt_profile(max_batch_size),
            )
            root = exported.directory / "trt"
            trt = trt_provider_options(device, cache, root)
            log.info("TensorRT engines for %s: %s", device, trt["trt_engine_cache_path"])
        # Only installed providers are requested: ONNX Runtime merely warns about the others.
        installed = ort.get_available_providers()
        providers = [p for p in providers_for(backend, device, trt) if p[0] in installed]
        check_providers(backend, device, [name for name, _ in providers], installed=True)
        if self.on_cuda and hasattr(ort, "preload_dlls"):
            with onnxruntime_warnings_logged():  # diagnostics about CUDA libraries, for the log
                ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels that PyTorch also uses
        options = session_options(exported.precision, threads)
        if enable_profiling:
            options.enable_profiling = True
            options.profile_file_prefix = str(exported.directory / f"profile-{backend}")
        t0 = time.perf_counter()
        if trt is None:
            self._open(exported, options, providers)
        else:
            h, w = self.spec.size
            trt_options = trt

            def build(engines: Path) -> None:
                # The session builds (or loads) the engine; one run proves it before it is kept.
                with_engines = {**trt_options, "trt_engine_cache_path": str(engines)}
                self._open(exported, options, [(TRT, with_engines), *providers[1:]])
                self.run(np.zeros((max_batch_size, h, w, 3), dtype=np.uint8))

            with_engine_cache(cache.engine_dir(root), cache.timing_dir(root), build)
        took, got = time.perf_counter() - t0, ", ".join(self.image.get_providers())
        log.info("%s session on %s ready in %.1f s (providers: %s)", backend, device, took, got)

    def _open(self, exported: ExportedModel, options: Any, providers: list[Any]) -> None:
        """Both sessions, then the buffers they are bound to."""
        self.image = self.ort.InferenceSession(str(exported.image), options, providers=providers)
        check_providers(self.backend, self.device, self.image.get_providers(), installed=False)
        # The normalisation prefix is tiny: CUDA (or CPU) is enough, TensorRT would add a build.
        prefix_providers = [p for p in providers if p[0] != TRT]
        self.normalize = self.ort.InferenceSession(
            str(exported.normalize), options, providers=prefix_providers
        )
        (h, w), n = self.spec.size, self.max_batch
        where = (self.float_dtype, self.device_type, self.device_id)
        self._x = self.ort.OrtValue.ortvalue_from_shape_and_type((n, 3, h, w), *where)
        self._y = self.ort.OrtValue.ortvalue_from_shape_and_type((n, self.info.embed_dim), *where)

    def _bind(self, binding: Any, name: str, value: Any, shape: tuple[int, ...], out: bool) -> None:
        bind = binding.bind_output if out else binding.bind_input
        bind(
            name, self.device_type, self.device_id, self.float_dtype, list(shape), value.data_ptr()
        )

    def run(self, batch: np.ndarray) -> np.ndarray:
        if not self.on_cuda:
            return self._run(batch)
        # "CUDA error cudaErrorIllegalAddress: ..." and the like leave the device unusable.
        with fatal_device_errors(self.device):
            return self._run(batch)

    def run_pixels(self, pixels: torch.Tensor) -> np.ndarray:
        """`run` for crops already on this device (GPU decode's), bound by address: no copy."""
        with fatal_device_errors(self.device):
            return self._run_pixels(pixels)

    def _run_pixels(self, pixels: torch.Tensor) -> np.ndarray:
        from clipserve.backends.torch_device import device_layer

        n = self._fits(check_pixels(pixels, self.spec, self.pixel_device))
        # torch queued the decode on its current stream; ONNX Runtime reads on its own.
        device_layer(pixels.device).current().synchronize()
        prefix = self.normalize.io_binding()
        shape = list(pixels.shape)
        prefix.bind_input(
            PIXELS, self.device_type, self.device_id, np.uint8, shape, pixels.data_ptr()
        )
        return self._embed(n, prefix)

    def _fits(self, n: int) -> int:
        if n > self.max_batch:
            raise ValueError(f"batch of {n} exceeds the preallocated {self.max_batch}")
        return n

    def _run(self, batch: np.ndarray) -> np.ndarray:
        check_batch(batch, self.spec)
        n = self._fits(batch.shape[0])
        if batch.dtype == np.uint8:
            prefix = self.normalize.io_binding()
            prefix.bind_cpu_input(PIXELS, np.ascontiguousarray(batch))  # the one input copy
            return self._embed(n, prefix)
        image = self.image.io_binding()
        image.bind_cpu_input(INPUT, np.ascontiguousarray(batch, dtype=self.float_dtype))
        return self._embed(n, None, image)

    def _embed(self, n: int, prefix: Any, image: Any = None) -> np.ndarray:
        """The image graph on `n` images: normalised first by `prefix` (the uint8 pixels bound
        to it) into the preallocated input, or `image` with its input bound already."""
        h, w = self.spec.size
        x_shape = (n, 3, h, w)
        if prefix is not None:
            self._bind(prefix, INPUT, self._x, x_shape, out=True)
            self.normalize.run_with_iobinding(prefix)
            image = self.image.io_binding()
            self._bind(image, INPUT, self._x, x_shape, out=False)
        self._bind(image, OUTPUT, self._y, (n, self.info.embed_dim), out=True)
        self.image.run_with_iobinding(image)
        out: np.ndarray = image.copy_outputs_to_cpu()[0]  # the one output copy
        return out.astype(np.float32, copy=False)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        h, w = self.spec.size
        self.run(np.zeros((max(batch_sizes), h, w, 3), dtype=np.uint8))
        for n in batch_sizes:
            self.run(np.zeros((n, h, w, 3), dtype=np.uint8))

    def memory(self) -> int | None:
        if not self.on_cuda:
            return None
        import torch

        free, total = torch.cuda.mem_get_info(self.device_id)
        return int(total - free)  # device-wide: ORT does not report its arena from Python

    def end_profiling(self) -> str:
        return str(self.image.end_profiling())

    def close(self) -> None:
        del self.image, self.normalize, self._x, self._y


def create(
    model: LoadedModel, spec: ExecutorSpec, device: str, *, profiling: bool = False
) -> OrtExecutor:
    """ort-cpu, ort-cuda or ort-trt (`spec.backend`) on `device`; `profiling` writes ORT's
    trace for `clipserve profile`."""
    backend = spec.backend
    precision = spec.precision or DEFAULT_PRECISION[backend]
    if precision not in SUPPORTED_PRECISIONS[backend]:
        raise StartupError(
            f"--precision {precision}: backend {backend} supports "
            f"{', '.join(SUPPORTED_PRECISIONS[backend])}"
        )
    if backend != "ort-cpu" and not is_cuda(device):
        raise StartupError(f"--backend {backend} needs a CUDA device; --gpus resolved to {device}")
    if backend == "ort-cpu" and not is_cpu(device):  # its buffers would be on the GPU
        raise StartupError(f"--backend ort-cpu serves on the CPU: pass --gpus cpu, not {device}")
    try:
        ort = import_onnxruntime()
    except ImportError as e:
        raise StartupError(
            f"--backend {backend}: onnxruntime cannot be imported ({e}); {INSTALL_HINT[backend]}"
        ) from None
    # Before the export, which takes minutes for a real model.
    check_providers(backend, device, ort.get_available_providers(), installed=True)
    # TensorRT takes the FP32 graph and builds FP16 kernels itself (trt_fp16_enable).
    graph_precision = "fp32" if backend == "ort-trt" else precision
    threads = resolve_workers(spec.threads) if is_cpu(device) else 1

    def open_(exported: ExportedModel) -> OrtExecutor:
        return OrtExecutor(
            exported,
            model,
            backend,
            device,
            precision,
            threads=threads,
            max_batch_size=spec.max_batch_size,
            enable_profiling=profiling,
        )

    return open_cached_export(model, spec.cache_dir, graph_precision, open_)
