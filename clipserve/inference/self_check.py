"""The startup self-check: after warm-up, canaries go through the served path as configured
and through a CPU FP32 PyTorch reference built from the same weights (open_clip's own towers;
for the simulated fake, itself on the CPU without its fault options); per tower, the worst
cosine between the two must reach the floor for that tower's precision.

Canary images are decoded by the server's decoder with default input limits, and each image
executor computes them on its own device thread fed as its device worker feeds it
(`batching.worker.feeding`): launched and waited for, up to --pipeline-depth in flight, where
the worker pipelines (CUDA: staging slots, the on-device normalisation and L2 normalisation),
else `run` and the host's L2 normalisation. With `--decode gpu` the canaries are decoded on the
CPU (nvJPEG has its own parity tests) and handed to the executor on its device where the worker
would hand it GPU-decoded crops (`launch_pixels`, `run_pixels`). Rows served L2-normalised must
also be of unit length. Canary texts, tokenised as the server tokenises them, go through each
text executor on its thread the same way.

So a backend that computes wrong numbers on a host (a driver, a TensorRT build, an FP16
overflow in either tower) is found in seconds at start, not from wrong embeddings in an index.
`strict` (the default on CUDA) keeps the server unready and logs a line per tower naming the
backend, device and worst cosine; `warn` (the default on the CPU) logs it; `off` skips it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image, ImageDraw

from clipserve.backends.base import l2_normalise_rows, normalise_numpy
from clipserve.backends.device import is_cuda
from clipserve.batching.worker import feeding
from clipserve.config import LimitsConfig
from clipserve.inference.preprocess import ImageDecoder

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from clipserve.backends.base import Executor, ExecutorSpec
    from clipserve.config import ServerConfig
    from clipserve.inference.gpu_decode import BatchDecoder
    from clipserve.inference.model import LoadedModel


class Runtime(Protocol):
    """What the check reads of `inference.runtime.Runtime` (which runs it at start-up)."""

    config: ServerConfig
    model: LoadedModel
    backend: str
    executors: list[Executor]
    threads: list[ThreadPoolExecutor]
    text_executors: list[Executor]
    text_threads: list[ThreadPoolExecutor]
    device_decoders: list[BatchDecoder]
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
# Short and long, punctuation, accents, CJK and an emoji (byte-level tokens), and one over any
# CLIP context (77 tokens): cut to fit, so every position of the text tower is exercised.
CANARY_TEXTS = (
    "a photo of a dog",
    "A red circle and a blue square on a grey background, drawn by hand.",
    "un café au lait, s'il vous plaît: 東京の夜景 🚀",
    " ".join(f"word{i}" for i in range(120)),
)


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
    if _simulated(runtime):
        return _on_cpu(runtime, batch, text=False)
    import torch

    x = torch.from_numpy(normalise_numpy(batch, runtime.model.preprocess))
    with torch.inference_mode():
        out: np.ndarray = runtime.model.module.visual(x).float().numpy()
    return out


def _text_reference(runtime: Runtime, tokens: np.ndarray) -> np.ndarray:
    """The CPU FP32 reference for token ids: open_clip's `encode_text` (normalised by the
    caller, as `normalize=True` would), or the simulated backend's text tower on the CPU."""
    if _simulated(runtime):
        return _on_cpu(runtime, tokens, text=True)
    import torch

    with torch.inference_mode():
        out: np.ndarray = runtime.model.module.encode_text(torch.from_numpy(tokens)).float().numpy()
    return out


def _simulated(runtime: Runtime) -> bool:
    from clipserve.backends.registry import BACKENDS

    assert runtime.spec is not None  # set by build_runtime before the check runs
    return BACKENDS[runtime.spec.backend].simulated


def _on_cpu(runtime: Runtime, inputs: np.ndarray, *, text: bool) -> np.ndarray:
    from clipserve.backends.registry import create_executor, create_text_executor

    spec = runtime.spec
    assert spec is not None
    create = create_text_executor if text else create_executor
    kept = {k: v for k, v in spec.options.items() if k == "compute"}
    reference = create(runtime.model, dataclasses.replace(spec, options=kept), "cpu")
    try:
        out: np.ndarray = reference.run(inputs)
        return out
    finally:
        reference.close()


def _served(
    executor: Executor, inputs: np.ndarray, max_batch: int, depth: int, decoder: str | None
) -> np.ndarray:
    """On the executor's thread: its L2-normalised rows for `inputs`, in batches of at most
    `max_batch`, through the side its worker feeds (`feeding`). Launched batches are waited
    for in launch order with at most `depth` in flight, as the worker keeps them."""
    asynchronous, pixels, launching = feeding(executor, depth, decoder)
    chunks = [inputs[i : i + max_batch] for i in range(0, len(inputs), max_batch)]
    if asynchronous is None:
        if pixels is not None:
            parts = [pixels.run_pixels(_device_crops(c, pixels.pixel_device)) for c in chunks]
        else:
            parts = [executor.run(c) for c in chunks]
        return _unit(np.concatenate(parts))  # normalised on the host, as the worker does
    in_flight: deque[object] = deque()
    rows: list[np.ndarray] = []
    try:
        for chunk in chunks:
            every = np.ones(len(chunk), bool)
            if launching is not None:
                crops = _device_crops(chunk, launching.pixel_device)
                in_flight.append(launching.launch_pixels(crops, every))
            else:
                in_flight.append(asynchronous.launch(list(chunk), every))
            if len(in_flight) >= depth:
                rows.append(asynchronous.wait(in_flight.popleft()))
        while in_flight:
            rows.append(asynchronous.wait(in_flight.popleft()))
    finally:  # a launch or wait that failed: the batches still launched give their slots back
        for handle in in_flight:
            with contextlib.suppress(Exception):
                asynchronous.wait(handle)
    return np.concatenate(rows)  # normalised on the device: served as they are


def _device_crops(batch: np.ndarray, device: str) -> torch.Tensor:
    """The CPU-decoded crops on `device`, where GPU decode would have left its own."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(batch)).to(device)


def _scores(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per row: the cosine to the (unit) reference row, or less where the served row is not of
    unit length (a wrong on-device normalisation keeps the direction); -1 if not finite."""
    rows = got.astype(np.float64)
    with np.errstate(all="ignore"):
        norms = np.linalg.norm(rows, axis=1)
        cosines = np.sum(rows * expected, axis=1) / norms
        scores = np.minimum(cosines, 1.0 - np.abs(norms - 1.0))
    out: np.ndarray = np.clip(np.nan_to_num(scores, nan=-1.0, posinf=-1.0, neginf=-1.0), -1, 1)
    return out


def _worst(
    runtime: Runtime,
    executors: Sequence[Executor],
    threads: Sequence[ThreadPoolExecutor],
    decoders: Sequence[str | None],
    inputs: np.ndarray,
    expected: np.ndarray,
) -> tuple[float, Executor]:
    """The worst score over every executor, and the executor that gave it."""
    batching = runtime.config.batching
    worst, where = 1.0, executors[0]
    for executor, thread, decoder in zip(executors, threads, decoders, strict=True):
        args = (executor, inputs, batching.max_batch_size, batching.pipeline_depth, decoder)
        try:
            got = thread.submit(_served, *args).result()
        except Exception as e:  # a device that fails the canaries fails the check
            info = executor.info
            log.error("self-check: %s on %s failed the canaries: %s", info.backend, info.device, e)
            got = np.full(expected.shape, np.nan, np.float32)
        low = float(_scores(got, expected).min())
        if low < worst:
            worst, where = low, executor
    return worst, where


def _report(tower: str, what: str, worst: float, n: int, floor: float, mode: str) -> bool:
    """Logs one tower's outcome; whether it passed."""
    line = f"self-check: {what} vs {REFERENCE}: worst cosine {worst:.6f} over {n} canary {tower}"
    if worst >= floor:
        log.info("%s (floor %g): passed", line, floor)
        return True
    if mode == "strict":
        log.error("%s, below the floor %g: not ready (--self-check strict)", line, floor)
    else:
        log.warning("%s, below the floor %g (--self-check warn: serving anyway)", line, floor)
    return False


def run_self_check(runtime: Runtime, mode: str) -> dict[str, Any]:
    """The check's result as `/info` reports it (`min_cosine`, `floor`: the image tower's;
    `text_*`: the text tower's); logs the outcome, a line per tower."""
    devices = runtime.devices
    if mode == "auto":
        mode = "strict" if any(is_cuda(d) for d in devices) else "warn"
    floor = FLOORS.get(runtime.precision, FLOORS["fp16"])
    text_precision = runtime.text_executors[0].info.precision
    text_floor = FLOORS.get(text_precision, FLOORS["fp16"])
    result: dict[str, Any] = {
        "status": "skipped",
        "mode": mode,
        "min_cosine": None,
        "floor": floor,
        "reference": REFERENCE,
        "images": 0,
        "text_min_cosine": None,
        "text_floor": text_floor,
        "texts": 0,
    }
    if mode == "off":
        return result
    # The server's decoding with default input limits: a tight --max-image-pixels is about
    # clients' images, not the canaries.
    decoder = ImageDecoder.from_limits(runtime.model.preprocess, LimitsConfig())
    batch = np.stack([decoder(image) for image in canary_images()])
    expected = _unit(_reference(runtime, batch))
    on: list[str | None] = [str(d.device) for d in runtime.device_decoders]
    on = on or [None] * len(runtime.executors)  # --decode cpu: the workers get no decoder
    worst, where = _worst(runtime, runtime.executors, runtime.threads, on, batch, expected)
    tokens = runtime.model.tokenize(list(CANARY_TEXTS))  # as the server tokenises: truncated
    texts = runtime.text_executors
    expected = _unit(_text_reference(runtime, tokens))
    unfed = [None] * len(texts)  # the text workers get no decoder
    text_worst, text_where = _worst(runtime, texts, runtime.text_threads, unfed, tokens, expected)
    what = f"{runtime.backend} on {where.info.device} ({runtime.precision})"
    passed = _report("images", what, worst, len(batch), floor, mode)
    info = text_where.info
    what = f"{info.backend} on {info.device} ({text_precision})"
    passed &= _report("texts", what, text_worst, len(tokens), text_floor, mode)
    result.update(
        status="passed" if passed else "failed",
        min_cosine=worst,
        images=len(batch),
        text_min_cosine=text_worst,
        texts=len(tokens),
    )
    return result


def _unit(rows: np.ndarray) -> np.ndarray:
    return l2_normalise_rows(rows.astype(np.float32), np.ones(len(rows), bool)).astype(np.float64)


def blocks_readiness(result: Mapping[str, Any] | None) -> bool:
    return result is not None and result["status"] == "failed" and result["mode"] == "strict"
