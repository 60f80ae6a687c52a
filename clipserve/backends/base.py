"""The executor interface: what the batcher needs from a backend, and nothing more."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from clipserve.config import ModelConfig
from clipserve.inference.preprocess import PreprocessSpec

if TYPE_CHECKING:
    import torch

    from clipserve.config import ServerConfig
    from clipserve.inference.model import LoadedModel


@dataclass(frozen=True)
class ExecutorInfo:
    backend: str
    device: str
    precision: str
    input_size: tuple[int, int]  # (height, width)
    embed_dim: int


@dataclass(frozen=True)
class ExecutorSpec:
    """What a backend factory needs to build one executor, and nothing else of the server's
    config: built once by `from_config`, so factories never read flags of other sections."""

    backend: str  # a registered backend ("auto" is resolved before any factory sees it)
    precision: str | None = None  # None: the backend's default for the device
    threads: int = 0  # intra-op threads for CPU inference; 0 = one per core
    compile: bool = False  # torch: torch.compile the model
    batch_buckets: str = ""  # cuda-graphs: sizes to capture ("" = powers of two)
    max_batch_size: int = 32  # the largest batch: warm-up, graph buckets, engine profiles
    cache_dir: Path = Path(ModelConfig.cache_dir)  # exported ONNX graphs, TensorRT engines
    options: Mapping[str, str] = field(default_factory=dict)  # --backend-option KEY=VALUE

    @classmethod
    def from_config(cls, config: ServerConfig) -> ExecutorSpec:
        """The spec for the configured backend ("auto" included: the runtime replaces it)."""
        b = config.backend
        return cls(
            backend=b.backend,
            precision=b.precision,
            threads=b.threads,
            compile=b.compile,
            batch_buckets=b.batch_buckets,
            max_batch_size=config.batching.max_batch_size,
            cache_dir=Path(config.model.cache_dir),
            options=b.options(),
        )


class Executor(Protocol):
    """Runs the image tower on one device.

    `run` takes uint8 NHWC at the model's input size and normalises on its device, or
    already-normalised float32/float16 NCHW, and returns float32 (N, embed_dim) embeddings,
    not L2-normalised. It is called from one worker thread at a time. It raises
    `ExecutorFatal` when its device can no longer serve; any other exception fails one batch.
    """

    info: ExecutorInfo

    def warmup(self, batch_sizes: Sequence[int]) -> None: ...

    def run(self, batch: np.ndarray) -> np.ndarray: ...

    def memory(self) -> int | None: ...

    def close(self) -> None: ...


class AsyncExecutor(Executor, Protocol):
    """An executor whose device computes while the host goes on, as a GPU stream does.

    `launch` (on the worker's device thread) assembles the batch, enqueues its copies and
    compute, and returns at once with a handle; `wait` (on the worker's completion thread, in
    launch order) blocks until that batch is done and returns float32 (N, embed_dim) rows, each
    L2-normalised on the device where `normalize` is true, in memory of their own (never a
    buffer a later batch reuses). A row that is not finite stays so. Either may raise: any
    exception fails the batch, which the worker then bisects through `run`; `ExecutorFatal`
    ends the worker. Executors without `launch`/`wait` (or with `asynchronous` false) keep the
    synchronous `run` path.
    """

    asynchronous: bool  # false where this executor's device is synchronous (the CPU)

    def launch(self, arrays: Sequence[np.ndarray], normalize: np.ndarray) -> object: ...

    def wait(self, launched: object) -> np.ndarray: ...


class PixelExecutor(Executor, Protocol):
    """An executor that takes a batch already on its device: uint8 NHWC crops in a torch tensor
    (GPU decode's output), so they never travel through the host.

    `pixel_device` is the torch device ("cuda:N", "cpu") such tensors must be on. `run_pixels`
    is `run` for them, reading the tensor after the work already queued on the calling thread's
    current stream (the decode that wrote it); it does not keep the tensor.
    """

    pixel_device: str

    def run_pixels(self, pixels: torch.Tensor) -> np.ndarray: ...


class AsyncPixelExecutor(PixelExecutor, AsyncExecutor, Protocol):
    """`launch` for a batch already on the device, in the same stream order as `run_pixels`;
    the tensor's memory is kept from reuse until the launched work has read it."""

    def launch_pixels(self, pixels: torch.Tensor, normalize: np.ndarray) -> object: ...


def takes_pixels(executor: Executor, device: str) -> PixelExecutor | None:
    """The executor's device-input side, if it takes tensors on `device` (a torch device name,
    indexed as GPU decode names it)."""
    if getattr(executor, "pixel_device", None) == device and hasattr(executor, "run_pixels"):
        return cast(PixelExecutor, executor)
    return None


def launches_pixels(executor: PixelExecutor) -> AsyncPixelExecutor | None:
    """The executor's asynchronous device-input side, if its device has one."""
    if as_async(executor) is not None and hasattr(executor, "launch_pixels"):
        return cast(AsyncPixelExecutor, executor)
    return None


def check_pixels(pixels: torch.Tensor, spec: PreprocessSpec, device: str) -> int:
    """The batch size of `pixels`, which must be contiguous uint8 NHWC at the model's input size
    on `device`; a programming error upstream otherwise, as `check_batch` says for arrays."""
    import torch

    h, w = spec.size
    if (
        pixels.dtype != torch.uint8
        or pixels.ndim != 4
        or tuple(pixels.shape[1:]) != (h, w, 3)
        or pixels.shape[0] < 1
        or not pixels.is_contiguous()
        or str(pixels.device) != device
    ):
        got = f"{tuple(pixels.shape)} {pixels.dtype} on {pixels.device}"
        raise ValueError(f"pixels {got} do not fit input ({h}, {w}, 3) on {device}")
    return int(pixels.shape[0])


# A backend's factory: (model, spec, device) → an executor, not yet warmed up.
Factory = Callable[["LoadedModel", ExecutorSpec, str], Executor]


def as_async(executor: Executor) -> AsyncExecutor | None:
    """The executor's asynchronous side, if its device has one."""
    if getattr(executor, "asynchronous", False) and hasattr(executor, "launch"):
        return cast(AsyncExecutor, executor)
    return None


def l2_normalise_rows(out: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Rows where `mask` is true scaled to unit length, on the host. Norms in float64: squares
    of large finite float32 values overflow float32 to inf. Rows that are already NaN or
    infinite stay so, quietly: the worker refuses them."""
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        scaled = (out / np.maximum(norms, 1e-12)).astype(np.float32)
    return np.where(mask[:, None], scaled, out)


def check_batch(batch: np.ndarray, spec: PreprocessSpec) -> None:
    """Reject a batch of the wrong layout: a programming error upstream, not a client error."""
    h, w = spec.size
    if batch.dtype == np.uint8:
        expected: tuple[int, ...] = (h, w, 3)
        got = batch.shape[1:]
    elif batch.dtype in (np.float32, np.float16):
        expected, got = (3, h, w), batch.shape[1:]
    else:
        raise TypeError(f"unsupported batch dtype {batch.dtype}")
    if batch.ndim != 4 or got != expected or batch.shape[0] < 1:
        raise ValueError(f"batch of shape {batch.shape} does not fit input {expected}")


def check_tokens(batch: np.ndarray, context_length: int) -> None:
    """Reject a text batch that is not int64 token ids (N, context_length): a programming error
    upstream, as `check_batch` is for images."""
    if batch.dtype != np.int64 or batch.ndim != 2 or batch.shape[1] != context_length:
        got = f"{batch.dtype} {batch.shape}"
        raise ValueError(f"expected int64 tokens (N, {context_length}); got {got}")


def normalisation_affine(spec: PreprocessSpec) -> tuple[np.ndarray, np.ndarray]:
    """Scale and bias that map uint8 pixels to normalised floats in one multiply-add."""
    std = np.asarray(spec.std, dtype=np.float64)
    mean = np.asarray(spec.mean, dtype=np.float64)
    scale = (1.0 / (255.0 * std)).astype(np.float32)
    bias = (-mean / std).astype(np.float32)
    return scale, bias


def normalise_numpy(batch: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """uint8 NHWC → float32 NCHW on the host, for CPU executors and reference computations."""
    scale, bias = normalisation_affine(spec)
    x = batch.astype(np.float32) * scale + bias
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def warmup_sizes(max_batch_size: int) -> list[int]:
    """Powers of two up to the largest batch, and the largest itself."""
    sizes, n = [], 1
    while n < max_batch_size:
        sizes.append(n)
        n *= 2
    sizes.append(max_batch_size)
    return sizes
