"""Backends by name, each imported only when chosen, so optional dependencies stay optional."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clipserve.backends.base import Executor
from clipserve.errors import StartupError

if TYPE_CHECKING:
    from clipserve.config import ServerConfig
    from clipserve.model import LoadedModel

log = logging.getLogger(__name__)

Factory = Callable[["LoadedModel", "ServerConfig", str], Executor]


@dataclass(frozen=True)
class BackendEntry:
    module: str
    extra: str | None  # the pip extra that provides its dependencies
    gpu_only: bool = False
    simulated: bool = False  # runs on simulated devices; needs no hardware
    create: str = "create"  # module attribute: (model, config, device) -> Executor
    available: str = "available"  # module attribute: (device) -> bool


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("clipserve.backends.torch_eager", None),
    "cuda-graphs": BackendEntry("clipserve.backends.cuda_graphs", None, gpu_only=True),
    "ort-cpu": BackendEntry("clipserve.backends.ort", None, create="create_cpu",
                            available="available_cpu"),
    "ort-cuda": BackendEntry("clipserve.backends.ort", "cuda", gpu_only=True,
                             create="create_cuda", available="available_cuda"),
    "ort-trt": BackendEntry("clipserve.backends.ort", "tensorrt", gpu_only=True,
                            create="create_trt", available="available_trt"),
    "fake": BackendEntry("clipserve.backends.fake", None, simulated=True),
}  # fmt: skip

# `--backend auto` tries these in order, keeping the first that is available on the device and
# starts there (runtime.py); each one skipped is logged with its reason.
# On the CPU torch comes before ort-cpu: faster at every batch size measured here
# (bench/results/executors-cpu.json), once torch runs on a single OpenMP team (runtime.py).
AUTO_ORDER = ("ort-trt", "cuda-graphs", "ort-cuda", "torch", "ort-cpu")


def _module(name: str) -> object:
    entry = BACKENDS[name]
    try:
        return importlib.import_module(entry.module)
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
    if spec == "cpu":
        return ["cpu"]
    if spec == "auto":
        return ["cuda:0"] if not simulated and cuda_device_count() else ["cpu"]
    ids = [int(i) for i in spec.split(",")]
    if len(set(ids)) != len(ids):
        raise StartupError(f"--gpus {gpus}: an id is listed twice")
    if simulated:
        return [f"sim:{i}" for i in ids]
    visible = cuda_device_count()
    missing = [i for i in ids if i >= visible]
    if missing:
        raise StartupError(
            f"--gpus {gpus}: no CUDA device {missing[0]} ({visible} visible); "
            "pass --gpus cpu to serve on the CPU"
        )
    return [f"cuda:{i}" for i in ids]


def unavailable_reason(name: str, device: str) -> str | None:
    """Why backend `name` cannot run on `device`, or None if it may (building it may still fail).
    A backend module may explain itself with `unavailable_reason(backend, device) -> str | None`."""
    entry = BACKENDS[name]
    if entry.gpu_only and not device.startswith("cuda"):
        return "needs a CUDA device"
    try:
        module = _module(name)
    except StartupError as e:
        return str(e)
    available: Callable[[str], bool] = getattr(module, entry.available)
    if available(device):
        return None
    explain: Callable[[str, str], str | None] | None = getattr(module, "unavailable_reason", None)
    return (explain(name, device) if explain else None) or f"not available on {device}"


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


def create_executor(name: str, model: LoadedModel, config: ServerConfig, device: str) -> Executor:
    module = _module(name)
    entry = BACKENDS[name]
    if entry.gpu_only and not device.startswith("cuda"):
        raise StartupError(f"--backend {name} needs a CUDA device; --gpus resolved to {device}")
    factory: Factory = getattr(module, entry.create)
    return factory(model, config, device)
