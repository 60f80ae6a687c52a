"""Backends by name. An entry's `load` imports the backend's module only when that backend is
chosen, so optional dependencies stay optional, and returns what the module provides: a factory
`(model, spec, device) -> Executor` for the image tower, optionally one for the text tower, and
the reason it cannot run on a device, if any."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clipserve.backends.base import Executor, ExecutorSpec, Factory
from clipserve.backends.device import (
    CPU,
    cuda_device,
    is_cuda,
    nvidia_device_files,
    simulated_device,
    torch_cuda_reason,
)
from clipserve.errors import StartupError

if TYPE_CHECKING:
    from clipserve.inference.model import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Implementation:
    """What a backend's module provides, once imported."""

    create: Factory
    # (backend, device) → why that backend cannot run on that device, or None if it may
    # (building it may still fail: `--backend auto` then tries the next).
    unavailable_reason: Callable[[str, str], str | None]
    create_text: Factory | None = None  # the text tower; None: PyTorch's (text_torch)


@dataclass(frozen=True)
class BackendEntry:
    load: Callable[[], Implementation]  # imports the backend's module; may raise ImportError
    extra: str | None  # the pip extra that provides its dependencies
    gpu_only: bool = False
    cpu_only: bool = False  # `--gpus auto` gives it the CPU, even on a GPU host
    simulated: bool = False  # runs on simulated devices; needs no hardware


def _torch() -> Implementation:
    from clipserve.backends import torch_eager

    return Implementation(torch_eager.create, torch_eager.unavailable_reason)


def _cuda_graphs() -> Implementation:
    from clipserve.backends import cuda_graphs

    return Implementation(cuda_graphs.create, cuda_graphs.unavailable_reason)


def _ort() -> Implementation:
    from clipserve.backends import ort

    return Implementation(ort.create, ort.unavailable_reason)


def _fake() -> Implementation:
    from clipserve.backends import fake

    return Implementation(fake.create, fake.unavailable_reason, create_text=fake.create_text)


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry(_torch, None),
    "cuda-graphs": BackendEntry(_cuda_graphs, None, gpu_only=True),
    "ort-cpu": BackendEntry(_ort, None, cpu_only=True),
    "ort-cuda": BackendEntry(_ort, "cuda", gpu_only=True),
    "ort-trt": BackendEntry(_ort, "tensorrt", gpu_only=True),
    "fake": BackendEntry(_fake, None, simulated=True),
}

# `--backend auto` tries these in order, keeping the first that is available on the device and
# starts there (inference/runtime.py); each one skipped is logged with its reason.
# On the CPU torch comes before ort-cpu: faster at every batch size measured here
# (bench/results/executors-cpu.json), on a single OpenMP team (inference/runtime.py).
AUTO_ORDER = ("ort-trt", "cuda-graphs", "ort-cuda", "torch", "ort-cpu")


def _load(name: str) -> Implementation:
    entry = BACKENDS[name]
    try:
        return entry.load()
    except ImportError as e:
        hint = f"pip install 'clipserve[{entry.extra}]'" if entry.extra else "reinstall clipserve"
        raise StartupError(f"--backend {name}: missing dependency ({e}); {hint}") from None


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(gpus: str, backend: str) -> list[str]:
    """Device names for `--gpus`: 'cpu', 'cuda:N', or 'sim:N' for simulated backends."""
    spec = gpus.replace(" ", "")
    simulated = backend in BACKENDS and BACKENDS[backend].simulated
    if spec == "cpu" or (spec == "auto" and backend in BACKENDS and BACKENDS[backend].cpu_only):
        return [CPU]
    if spec == "auto":
        if simulated or cuda_device_count():
            return [CPU] if simulated else [cuda_device(0)]
        if nvidia_device_files():  # a GPU is there, and we would silently not use it
            log.warning(
                "--gpus auto: serving on the CPU although NVIDIA devices exist: %s "
                "(clipserve doctor explains this host)",
                torch_cuda_reason(),
            )
        return [CPU]
    ids = [int(i) for i in spec.split(",")]
    if len(set(ids)) != len(ids):
        raise StartupError(f"--gpus {gpus}: an id is listed twice")
    if simulated:
        return [simulated_device(i) for i in ids]
    visible = cuda_device_count()
    missing = [i for i in ids if i >= visible]
    if missing:
        raise StartupError(
            f"--gpus {gpus}: no CUDA device {missing[0]} ({visible} visible); "
            "pass --gpus cpu to serve on the CPU"
        )
    return [cuda_device(i) for i in ids]


def unavailable_reason(name: str, device: str) -> str | None:
    """Why backend `name` cannot run on `device`, or None if it may (building it may still fail)."""
    if BACKENDS[name].gpu_only and not is_cuda(device):
        return "needs a CUDA device"
    try:
        implementation = _load(name)
    except StartupError as e:
        return str(e)
    return implementation.unavailable_reason(name, device)


def backend_candidates(name: str, device: str) -> list[str]:
    """`--backend NAME` → [NAME]. `auto` → every backend of AUTO_ORDER that may run on `device`,
    best first; each one left out is logged with its reason. The runtime builds them in turn
    and keeps the first that starts, so a backend that fails to start is skipped too."""
    if name != "auto":
        if name not in BACKENDS:
            choices = ", ".join(["auto", *sorted(BACKENDS)])
            raise StartupError(f"--backend: unknown backend {name!r}; choose one of {choices}")
        return [name]
    candidates = []
    for candidate in AUTO_ORDER:
        if candidate not in BACKENDS:
            continue
        reason = unavailable_reason(candidate, device)
        if reason is None:
            candidates.append(candidate)
        else:
            log.info("--backend auto: skipping %s on %s: %s", candidate, device, reason)
    if not candidates:
        raise StartupError(f"--backend auto: no backend can run on {device}")
    return candidates


def create_executor(model: LoadedModel, spec: ExecutorSpec, device: str) -> Executor:
    """The image tower of backend `spec.backend` on `device`, not yet warmed up."""
    implementation = _load(spec.backend)
    if BACKENDS[spec.backend].gpu_only and not is_cuda(device):
        raise StartupError(
            f"--backend {spec.backend} needs a CUDA device; --gpus resolved to {device}"
        )
    return implementation.create(model, spec, device)


def create_text_executor(model: LoadedModel, spec: ExecutorSpec, device: str) -> Executor:
    """The text tower beside `spec.backend`'s image tower on `device`: the backend's own where
    it has one (the fake), else PyTorch's, which every installation has."""
    create = _load(spec.backend).create_text
    if create is None:
        from clipserve.backends import text_torch

        create = text_torch.create
    return create(model, spec, device)
