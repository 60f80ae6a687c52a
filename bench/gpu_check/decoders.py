"""The decoders section: nvJPEG (inference/gpu_decode.py) against Pillow on one core, 640x480
JPEGs to 224x224 crops: how many cores of Pillow the device decoder stands for."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.gpu_check.plan import Emit, Plan


def rates(decode: Callable[[], int]) -> tuple[float, float]:
    """Images per second of wall time and of this process's CPU time, for one call of
    `decode` (which answers how many images it decoded)."""
    wall, cpu = time.perf_counter(), time.process_time()
    n = decode()
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def section_decoders(plan: Plan, emit: Emit) -> dict[str, Any]:
    """Pillow's draft path on one thread against the device decoder, in interleaved rounds;
    per core = images per second of the CPU time the process spent."""
    import torch

    from bench.common import CLIP_SPEC
    from bench.decoders import corpus
    from clipserve.inference.gpu_decode import DeviceDecoder
    from clipserve.inference.preprocess import ImageDecoder

    torch.set_num_threads(1)
    images = corpus(16)
    batch = (images * 64)[: 32 if plan.quick else 256]
    host = ImageDecoder(CLIP_SPEC, 40_000_000)
    dev = DeviceDecoder(host, plan.device)
    sync: Callable[[], None] = torch.cuda.synchronize if plan.cuda else (lambda: None)

    def pillow() -> int:
        for data in batch:
            host(data)
        return len(batch)

    def device() -> int:
        result = dev.decode(batch)
        sync()
        assert len(result.ok) == len(batch), result.errors
        return len(batch)

    rates(device)  # nvJPEG's handles and buffers, the resize kernels
    rounds: dict[str, list[tuple[float, float]]] = {"pillow": [], "device": []}
    for _ in range(3 if plan.quick else 9):
        rounds["pillow"].append(rates(pillow))
        rounds["device"].append(rates(device))
    out: dict[str, Any] = {"input": "640x480 q90 JPEG -> 224x224", "batch": len(batch)}
    for name, samples in rounds.items():
        walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
        out[name] = {
            "images_per_s": round(statistics.median(walls), 1),
            "images_per_s_min": round(min(walls), 1),
            "images_per_s_max": round(max(walls), 1),
            "images_per_cpu_s": round(statistics.median(cpus), 1),
        }
    # How many cores of Pillow the device decoder stands for.
    out["device_in_pillow_cores"] = round(
        out["device"]["images_per_s"] / out["pillow"]["images_per_cpu_s"], 2
    )
    emit(out)
    out["large_batch"] = large_batch(plan, dev, sync)
    emit(out)
    out["corrupt"] = corrupt_corpus(dev)
    emit(out)
    out["decode_processes"] = decode_processes(plan, dev, batch[:32])
    return out


def decode_processes(plan: Plan, dev: Any, images: list[bytes]) -> dict[str, Any]:
    """`--decode gpu` on several devices decodes in a process per device
    (inference/decode_process.py): its crops, back through CUDA IPC, must equal this process's
    decode row for row, on this device and on a second GPU where there is one."""
    import numpy as np
    import torch

    from clipserve.config import LimitsConfig
    from clipserve.inference.decode_process import DecodeProcess
    from clipserve.inference.gpu_decode import crops_numpy

    want = crops_numpy(dev.decode(images))
    devices = [plan.device]
    if plan.cuda and torch.cuda.device_count() > 1:
        devices.append(f"cuda:{(int(torch.device(plan.device).index or 0) + 1) % 2}")
    out: dict[str, Any] = {"images": len(images)}
    for device in devices:
        child = DecodeProcess(dev.host.spec, LimitsConfig(), device)
        try:
            child.wait_ready()
            seconds = []
            for _ in range(3):
                t0 = time.perf_counter()
                got = child.decode(images)
                seconds.append(time.perf_counter() - t0)
            out[device] = {
                "rows_equal": bool(np.array_equal(crops_numpy(got), want)),
                "on_device": str(got.pixels.device),
                "images_per_s": round(len(images) / statistics.median(seconds), 1),
            }
        finally:
            child.close()
    return out


def large_batch(plan: Plan, dev: Any, sync: Callable[[], None]) -> dict[str, Any]:
    """One batch of more than MAX_DECODE_PIXELS (2^27), so it decodes in several chunks (the
    path whose outputs must outlive their readers); each crop must equal its image decoded
    alone. Without a GPU (--quick) the chunk bound is lowered instead of the batch grown."""
    import numpy as np

    from clipserve.inference.gpu_decode import MAX_DECODE_PIXELS, DeviceDecoder, crops_numpy
    from clipserve.loadgen.images import jpeg

    width, height = (1920, 1080) if plan.cuda else (640, 480)
    bound = MAX_DECODE_PIXELS if plan.cuda else 4 * width * height
    count = bound // (width * height) + 8
    images = [jpeg(width, height, seed=i % 16) for i in range(count)]
    chunked = DeviceDecoder(dev.host, plan.device, max_decode_pixels=bound)
    t0 = time.perf_counter()
    batch = chunked.decode(images)
    sync()
    seconds = time.perf_counter() - t0
    crops = crops_numpy(batch)
    alone = np.stack([crops_numpy(chunked.decode([data]))[0] for data in images[:16]])
    return {
        "images": count,
        "pixels": count * width * height,
        "max_decode_pixels": bound,
        "seconds": round(seconds, 3),
        "all_decoded": batch.ok == list(range(count)),
        "rows_equal_alone": bool(np.array_equal(crops[:16], alone)),
    }


def corrupt_corpus(dev: Any) -> dict[str, str]:
    """Each corrupt JPEG of tests/inference/corrupt_jpeg.py through the device decoder: the
    error code it gets ("decoded" would be a wrong embedding served)."""
    from tests.inference.corrupt_jpeg import corpus

    out = {}
    for name, data in corpus().items():
        batch = dev.decode([data])
        out[name] = batch.errors[0].code if 0 in batch.errors else "decoded"
    return out
