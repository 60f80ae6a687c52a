"""The text tower on PyTorch, on the same device (and device thread) as the image executor.

On CUDA it runs on a stream of its own, never the device's default stream, so text batches do
not queue behind image batches (or an ONNX Runtime image executor's default-stream copies).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clipserve.backends.base import ExecutorInfo, ExecutorSpec, check_tokens
from clipserve.backends.device import (
    device_context,
    fatal_device_errors,
    is_cuda,
    torch_device_name,
)
from clipserve.backends.torch_eager import default_precision, own_stream

if TYPE_CHECKING:
    from clipserve.inference.model import LoadedModel

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class TextExecutor:
    """int64 token ids (N, context_length) → float32 (N, embed_dim), not L2-normalised."""

    def __init__(self, model: LoadedModel, device: str, precision: str | None = None) -> None:
        self.device = torch.device(device)
        precision = precision or default_precision(device)
        visual = model.module.visual
        model.module.visual = torch.nn.Identity()  # copy only the text side
        try:
            module = copy.deepcopy(model.module)
        finally:
            model.module.visual = visual
        self.is_cuda = self.device.type == "cuda"
        with device_context(device):
            self.module: Any = module.to(self.device, _DTYPES[precision]).eval()
            self.stream = own_stream(self.device)
            if self.stream is not None:  # the weights were copied on the current stream
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.context_length = int(model.context_length)
        self.info = ExecutorInfo("torch-text", str(self.device), precision, (0, 0), model.embed_dim)

    def run(self, batch: np.ndarray) -> np.ndarray:
        check_tokens(batch, self.context_length)
        if not self.is_cuda:
            with torch.inference_mode():
                out: np.ndarray = self.module.encode_text(torch.from_numpy(batch)).float().numpy()
            return out
        with (
            fatal_device_errors(self.info.device),
            device_context(self.info.device),
            torch.inference_mode(),
            torch.cuda.stream(self.stream),
        ):
            tokens = torch.from_numpy(batch).pin_memory().to(self.device, non_blocking=True)
            out = self.module.encode_text(tokens).float().cpu().numpy()
        return out

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        for n in batch_sizes:
            self.run(np.zeros((n, self.context_length), dtype=np.int64))

    def memory(self) -> int | None:
        return None  # counted with the image executor on the same device

    def close(self) -> None:
        del self.module
        if self.is_cuda:
            with device_context(self.info.device):
                torch.cuda.empty_cache()


def create(model: LoadedModel, spec: ExecutorSpec, device: str) -> TextExecutor:
    """The text tower beside any image backend: at its precision on CUDA, FP32 elsewhere; a
    simulated device's text tower runs on the CPU."""
    if is_cuda(device):
        return TextExecutor(model, device, spec.precision)
    return TextExecutor(model, torch_device_name(device), "fp32")
