"""The heavy objects a server needs: the model, one warmed-up executor per device, the decoder."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from clipserve.backends.base import Executor, warmup_sizes
from clipserve.backends.registry import create_executor, resolve_backend, resolve_devices
from clipserve.config import ServerConfig
from clipserve.model import LoadedModel, load_model
from clipserve.preprocess import ImageDecoder

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    model: LoadedModel
    backend: str
    executors: list[Executor]
    decoder: ImageDecoder

    def close(self) -> None:
        for executor in reversed(self.executors):
            executor.close()


def build_runtime(config: ServerConfig) -> Runtime:
    """Load, build and warm up everything; raises StartupError with a one-line reason."""
    model = load_model(config.model)
    devices = resolve_devices(config.backend.gpus, config.backend.backend)
    backend = resolve_backend(config.backend.backend, devices[0])
    executors: list[Executor] = []
    try:
        for device in devices:
            executors.append(create_executor(backend, model, config, device))
        sizes = warmup_sizes(config.batching.max_batch_size)
        for executor in executors:
            t0 = time.perf_counter()
            executor.warmup(sizes)
            log.info(
                "warmed up %s on %s (%s) over batch sizes %s in %.1f s",
                backend, executor.info.device, executor.info.precision, sizes,
                time.perf_counter() - t0,
            )  # fmt: skip
    except BaseException:
        for executor in executors:
            executor.close()
        raise
    decoder = ImageDecoder(model.preprocess, config.limits.max_image_pixels)
    return Runtime(model, backend, executors, decoder)
