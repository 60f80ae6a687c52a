"""PyTorch eager executor: FP32 anywhere, FP16 on CUDA; normalises uint8 input on its device."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clipserve.backends.base import ExecutorInfo, check_batch, normalisation_affine
from clipserve.backends.device import device_context, fatal_device_errors
from clipserve.config import resolve_workers
from clipserve.errors import StartupError

if TYPE_CHECKING:
    from clipserve.config import ServerConfig
    from clipserve.model import LoadedModel

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def available(device: str) -> bool:
    return device == "cpu" or (device.startswith("cuda") and torch.cuda.is_available())


def default_precision(device: str) -> str:
    return "fp16" if device.startswith("cuda") else "fp32"


def check_precision(backend: str, precision: str, device: str) -> None:
    if precision == "fp16" and not device.startswith("cuda"):
        raise StartupError(
            f"--precision fp16: backend {backend} supports fp16 only on CUDA devices "
            f"(device is {device}); pass --precision fp32"
        )


def configure_cpu_threads(config: ServerConfig) -> int:
    """Intra-op threads are process-wide in PyTorch; set them once from --threads."""
    threads = resolve_workers(config.backend.threads)
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
        self.dtype = _DTYPES[precision]
        self.spec = model.preprocess
        self.is_cuda = self.device.type == "cuda"
        with device_context(device):
            self.visual: Any = copy.deepcopy(model.module.visual).to(self.device, self.dtype)
            self.visual.eval()
            scale, bias = normalisation_affine(self.spec)
            self._scale = torch.from_numpy(scale).view(1, 3, 1, 1).to(self.device)
            self._bias = torch.from_numpy(bias).view(1, 3, 1, 1).to(self.device)
            # Its own stream (PyTorch's pool streams do not synchronise with the default stream),
            # so image batches never queue behind the text tower or a library's default-stream work.
            self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None  # type: ignore[no-untyped-call]
        if compile:  # shapes vary with the batch size: compile for dynamic batch once
            self.visual = torch.compile(self.visual, dynamic=True)
        self.info = ExecutorInfo(
            backend, str(self.device), precision, self.spec.size, model.embed_dim
        )

    def _to_device(self, batch: np.ndarray) -> torch.Tensor:
        if not batch.flags.writeable:  # e.g. straight from PIL; torch cannot wrap read-only memory
            batch = batch.copy()
        x = torch.from_numpy(batch)
        if self.is_cuda:
            x = x.pin_memory().to(self.device, non_blocking=True)
        return self.normalise(x) if batch.dtype == np.uint8 else x.to(self.dtype)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC on the device → normalised NCHW in the model's dtype. The permuted view
        keeps channels-last strides, the layout the patch-embedding convolution prefers."""
        return x.permute(0, 3, 1, 2).float().mul_(self._scale).add_(self._bias).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.visual(x)  # type: ignore[no-any-return]

    def run(self, batch: np.ndarray) -> np.ndarray:
        check_batch(batch, self.spec)
        if not self.is_cuda:
            with torch.inference_mode():
                return self.forward(self._to_device(batch)).float().numpy()
        # A fatal CUDA error (illegal address, ECC, device lost) leaves the context unusable:
        # ExecutorFatal stops this worker. Out-of-memory passes through: the batch is split.
        with (
            fatal_device_errors(self.info.device),
            device_context(self.info.device),
            torch.inference_mode(),
            torch.cuda.stream(self.stream),
        ):
            out = self.forward(self._to_device(batch)).float()
            return out.cpu().numpy()  # the copy waits on this stream's work

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        h, w = self.spec.size
        for n in batch_sizes:
            self.run(np.zeros((n, h, w, 3), dtype=np.uint8))

    def memory(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device)) if self.is_cuda else None

    def close(self) -> None:
        del self.visual
        if self.is_cuda:
            with device_context(self.info.device):
                torch.cuda.empty_cache()


def create(model: LoadedModel, config: ServerConfig, device: str) -> TorchExecutor:
    precision = config.backend.precision or default_precision(device)
    check_precision("torch", precision, device)
    if device == "cpu":
        configure_cpu_threads(config)
    return TorchExecutor(model, device, precision, compile=config.backend.compile)
