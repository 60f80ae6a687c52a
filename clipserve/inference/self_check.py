"""The startup self-check: after warm-up, canary images go through the served path as
configured (the server's decoder with default input limits, each image executor on its own
device thread, the host's normalisation) and through a CPU FP32 PyTorch reference built from
the same weights; the worst cosine between the two must reach the floor for the precision.

So a backend that computes wrong numbers on a host (a driver, a TensorRT build, an FP16
overflow) is found in seconds at start, not from wrong embeddings in an index. `strict` (the
default on CUDA) keeps the server unready and logs one line naming the backend, device and
worst cosine; `warn` (the default on the CPU) logs it; `off` skips it. With `--decode gpu` the
canaries are decoded on the CPU (nvJPEG has its own parity tests).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image, ImageDraw

from clipserve.backends.base import l2_normalise_rows, normalise_numpy
from clipserve.backends.device import is_cuda
from clipserve.config import LimitsConfig
from clipserve.inference.preprocess import ImageDecoder

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from clipserve.backends.base import Executor, ExecutorSpec
    from clipserve.config import ServerConfig
    from clipserve.inference.model import LoadedModel


class Runtime(Protocol):
    """What the check reads of `inference.runtime.Runtime` (which runs it at start-up)."""

    config: ServerConfig
    model: LoadedModel
    backend: str
    executors: list[Executor]
    threads: list[ThreadPoolExecutor]
    spec: ExecutorSpec | None

    @property
    def devices(self) -> list[str]: ...

    @property
    def precision(self) -> str: ...


log = logging.getLogger(__name__)

# The worst cosine a precision may show against the CPU FP32 reference on the canaries.
FLOORS = {"fp32": 0.9999, "fp16": 0.999, "bf16": 0.995, "int8": 0.99}
REFERENCE = "torch-cpu-fp32"
CANARY_SIZES = ((640, 480, "JPEG"), (480, 640, "JPEG"), (224, 224, "PNG"), (1000, 300, "JPEG"))


def canary_images() -> list[bytes]:
    """Deterministic photographs' stand-ins: gradients, shapes and noise, as JPEG and PNG
    (the same bytes on every host: drawn from a fixed seed with Pillow's primitives)."""
    rng = np.random.default_rng(20261124)
    images = []
    for i, (w, h, fmt) in enumerate(CANARY_SIZES):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], axis=-1)
        noise = rng.integers(0, 40, (h, w, 3))
        image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for j in range(6):
            x0, y0 = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
            box = (x0, y0, x0 + int(rng.integers(20, w // 3)), y0 + int(rng.integers(20, h // 3)))
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            (draw.ellipse if (i + j) % 2 else draw.rectangle)(box, fill=colour)
        # A light frame: every crop's first pixel is far from the small values the fake
        # backend's fault options (fail_pixel, hang_pixel, ...) look for in tests.
        draw.rectangle((0, 0, w - 1, h - 1), outline=(200, 200, 200), width=min(w, h) // 10)
        out = io.BytesIO()
        image.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        images.append(out.getvalue())
    return images


def _reference(runtime: Runtime, batch: np.ndarray) -> np.ndarray:
    """The CPU FP32 reference for uint8 NHWC crops: open_clip's own image tower, or for a
    simulated backend (no model runs) the same backend on the CPU with no fault options."""
    from clipserve.backends.registry import BACKENDS, create_executor

    spec = runtime.spec
    assert spec is not None  # set by build_runtime before the check runs
    if BACKENDS[spec.backend].simulated:
        kept = {k: v for k, v in spec.options.items() if k == "compute"}
        reference = create_executor(runtime.model, dataclasses.replace(spec, options=kept), "cpu")
        try:
            return reference.run(batch)
        finally:
            reference.close()
    import torch

    x = torch.from_numpy(normalise_numpy(batch, runtime.model.preprocess))
    with torch.inference_mode():
        out: np.ndarray = runtime.model.module.visual(x).float().numpy()
    return out


def _served(executor: Executor, batch: np.ndarray, max_batch: int) -> np.ndarray:
    parts = [executor.run(batch[i : i + max_batch]) for i in range(0, len(batch), max_batch)]
    return np.concatenate(parts)


def run_self_check(runtime: Runtime, mode: str) -> dict[str, Any]:
    """The check's result as `/info` reports it; logs the outcome."""
    devices = runtime.devices
    if mode == "auto":
        mode = "strict" if any(is_cuda(d) for d in devices) else "warn"
    floor = FLOORS.get(runtime.precision, FLOORS["fp16"])
    result: dict[str, Any] = {
        "status": "skipped",
        "mode": mode,
        "min_cosine": None,
        "floor": floor,
        "reference": REFERENCE,
        "images": 0,
    }
    if mode == "off":
        return result
    # The server's decoding with default input limits: a tight --max-image-pixels is about
    # clients' images, not the canaries.
    decoder = ImageDecoder.from_limits(runtime.model.preprocess, LimitsConfig())
    batch = np.stack([decoder(image) for image in canary_images()])
    every = np.ones(len(batch), bool)
    expected = l2_normalise_rows(_reference(runtime, batch).astype(np.float32), every)
    worst, where = 1.0, devices[0]
    for executor, thread in zip(runtime.executors, runtime.threads, strict=True):
        max_batch = runtime.config.batching.max_batch_size
        try:
            got = thread.submit(_served, executor, batch, max_batch).result()
        except Exception as e:  # a device that fails the canaries fails the check
            log.error("self-check: %s failed on the canaries: %s", executor.info.device, e)
            got = np.full(expected.shape, np.nan, np.float32)
        cosines = np.sum(l2_normalise_rows(got.astype(np.float32), every) * expected, axis=1)
        low = float(np.nan_to_num(cosines, nan=-1.0).min())
        if low < worst:
            worst, where = low, executor.info.device
    passed = worst >= floor
    result.update(status="passed" if passed else "failed", min_cosine=worst, images=len(batch))
    what = f"{runtime.backend} on {where} ({runtime.precision})"
    line = f"self-check: {what} vs {REFERENCE}: worst cosine {worst:.6f} over {len(batch)} canaries"
    if passed:
        log.info("%s (floor %g): passed", line, floor)
    elif mode == "strict":
        log.error("%s, below the floor %g: not ready (--self-check strict)", line, floor)
    else:
        log.warning("%s, below the floor %g (--self-check warn: serving anyway)", line, floor)
    return result


def blocks_readiness(result: Mapping[str, Any] | None) -> bool:
    return result is not None and result["status"] == "failed" and result["mode"] == "strict"
