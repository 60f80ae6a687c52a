"""Device names and what kind of device each is, which GPU a thread talks to, and what a device
error means for the worker that saw it.

CUDA's current device is per host thread and starts at 0, so a thread that touches CUDA before
selecting its device creates a context on GPU 0: `--gpus 1` would still take memory there. Each
device thread therefore selects its device first (`select_device`, the thread pool's
initialiser); on the CPU and on simulated devices nothing calls into CUDA.

Errors: some CUDA errors leave the context unusable ("sticky": illegal address, launch failure,
ECC, device-side assert, a lost device), and every later call fails the same way, so the
worker must stop (`ExecutorFatal`) and `/readyz` must say so. Out-of-memory is the opposite: the
batcher splits the batch and smaller halves may fit. `is_fatal_device_error` is the one place
that tells them apart, for PyTorch and ONNX Runtime alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from clipserve.errors import ExecutorFatal

_bound = threading.local()

# Lower-case fragments of messages that mean the device context is lost. PyTorch: "CUDA error:
# an illegal memory access was encountered" (torch.AcceleratorError from 2.8, RuntimeError
# before), "CUDA driver error: ...". ONNX Runtime's CUDA EP: "CUDA error cudaErrorIllegalAddress:
# ...", "CUDA failure 700: ...", "CUBLAS failure 13: CUBLAS_STATUS_EXECUTION_FAILED ...".
FATAL_MARKERS = (
    "cuda error",
    "cuda failure",
    "cuda driver error",
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "ecc error",
    "device-side assert",
    "launch timed out",
    "gpu is lost",
    "fallen off the bus",
    "no cuda-capable device",
    "status_execution_failed",  # CUBLAS_/CUDNN_STATUS_EXECUTION_FAILED: a kernel faulted
)
# Allocation failures: the batcher retries smaller batches, so these are never fatal.
OOM_MARKERS = (
    "out of memory",  # torch's "CUDA out of memory", "CUDA error: out of memory"
    "failed to allocate memory",  # ORT's BFC arena
    "available memory of",  # ORT: "Available memory of N is smaller than requested bytes of M"
    "status_alloc_failed",  # CUBLAS_/CUDNN_STATUS_ALLOC_FAILED
    "cudaerrormemoryallocation",
)
# CUDA errors tied to one launch's shape, not sticky: a smaller batch may well run.
RECOVERABLE_MARKERS = (
    "too many resources requested for launch",
    "invalid configuration argument",
    "cudaerrorlaunchoutofresources",
    "cudaerrorinvalidconfiguration",
)


# Device names, as `--gpus` resolves them: "cpu", "cuda:N", or "sim:N" (a simulated device, for
# backends that need no hardware). Every other module asks the functions below what a name is.
CPU = "cpu"
_CUDA = "cuda"
_SIMULATED = "sim"


def cuda_device(index: int) -> str:
    return f"{_CUDA}:{index}"


def simulated_device(index: int) -> str:
    return f"{_SIMULATED}:{index}"


def cuda_index(device: str) -> int | None:
    """'cuda:3' → 3, 'cuda' → 0; None for 'cpu' and simulated 'sim:N' devices."""
    if device == _CUDA:
        return 0
    kind, sep, index = device.partition(":")
    return int(index) if sep and kind == _CUDA else None


def is_cuda(device: str) -> bool:
    """A CUDA device ('cuda', 'cuda:N'): the one question every layer asks of a device name."""
    return cuda_index(device) is not None


def is_cpu(device: str) -> bool:
    return device == CPU


def torch_device_name(device: str) -> str:
    """Where torch computes for `device`: a CUDA device itself; the CPU for the CPU and for
    simulated devices (whose towers run real code on the host: the text tower, GPU decode)."""
    return device if is_cuda(device) else CPU


def indexed_torch_device(device: str) -> str:
    """`torch_device_name` with the index written out ("cuda" is "cuda:0"): how GPU decode names
    the device its crops are on, and so what an executor that takes them compares with."""
    index = cuda_index(device)
    return CPU if index is None else cuda_device(index)


def select_device(device: str) -> None:
    """Thread initialiser: make `device` this thread's current CUDA device before anything else
    runs on it. On the CPU and on simulated devices nothing touches CUDA."""
    _bound.device = device
    index = cuda_index(device)
    if index is not None:
        import torch

        torch.cuda.set_device(index)


def selected_device() -> str | None:
    """The device this thread was initialised for, if any."""
    return getattr(_bound, "device", None)


def _accelerator_error() -> type[BaseException] | None:
    import torch

    # torch.AcceleratorError exists from PyTorch 2.8; earlier versions raise RuntimeError.
    found = getattr(torch, "AcceleratorError", None)
    return found if isinstance(found, type) else None


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in OOM_MARKERS)


def is_fatal_device_error(exc: BaseException) -> bool:
    """True when the device context can no longer be trusted: the worker must stop."""
    if isinstance(exc, ExecutorFatal):
        return True
    if is_out_of_memory(exc):
        return False
    text = str(exc).lower()
    if any(marker in text for marker in RECOVERABLE_MARKERS):
        return False
    accelerator_error = _accelerator_error()
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return any(marker in text for marker in FATAL_MARKERS)


@contextlib.contextmanager
def fatal_device_errors(device: str) -> Iterator[None]:
    """Re-raise a fatal device error as `ExecutorFatal`; any other exception passes unchanged
    (it fails one batch, which the batcher may split and retry)."""
    try:
        yield
    except ExecutorFatal:
        raise
    except Exception as exc:
        if is_fatal_device_error(exc):
            raise ExecutorFatal(f"{device}: {type(exc).__name__}: {exc}") from exc
        raise


def device_context(device: str) -> contextlib.AbstractContextManager[object]:
    """`torch.cuda.device(...)` for a CUDA device (cheap when it is already current), nothing
    otherwise: code that may run on another thread still allocates and captures on its own GPU."""
    index = cuda_index(device)
    if index is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(index)


def nvidia_device_files() -> list[str]:
    """/dev/nvidia*: a GPU this process could see, whatever torch says."""
    return sorted(p.name for p in Path("/dev").glob("nvidia*"))


def torch_cuda_reason() -> str | None:
    """Why torch sees no CUDA device (None: it does)."""
    import torch

    if torch.cuda.is_available():
        return None
    files = nvidia_device_files()
    if torch.version.cuda is None:
        return "this torch is a CPU-only build" + (
            f" (NVIDIA devices present: {files})" if files else ""
        )
    if not files:
        return "no NVIDIA device files in /dev (no GPU, or not passed to this container)"
    try:
        torch.cuda.init()  # type: ignore[no-untyped-call]
    except Exception as e:  # the driver's own reason: too old, no device, ...
        return f"CUDA initialisation failed: {str(e).splitlines()[0]}"
    return "CUDA reports no usable device (CUDA_VISIBLE_DEVICES?)"
