"""The `clipserve export` and `clipserve profile` subcommands."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from clipserve.config import ServerConfig


def export_main(config: ServerConfig, output: Path | None) -> int:
    """Export the image tower (dynamic batch, opset 18), check it, compare it with PyTorch."""
    from clipserve.backends.onnx_export import cached_export, export, meta_path
    from clipserve.inference.model import load_model

    model = load_model(config.model)
    precision = config.backend.precision or "fp32"
    if output is None:
        exported = cached_export(model, Path(config.model.cache_dir), precision)
    else:
        exported = export(model, output, precision)
    meta = json.loads(meta_path(exported.directory, precision).read_text())
    print(f"model      {model.identity} ({precision})")
    print(f"image      {exported.image}")
    print(f"normalize  {exported.normalize}")
    print("checker    passed (onnx.checker, full_check)")
    print(f"vs PyTorch min cosine {meta['min_cosine_vs_torch']:.7f} over a random batch")
    return 0


def summarise_profile(events: Iterable[Mapping[str, Any]]) -> tuple[dict[str, float], list[str]]:
    """ORT profile events → (share of node time per op type, nodes that ran on the CPU EP)."""
    per_op: dict[str, float] = defaultdict(float)
    on_cpu: set[str] = set()
    for event in events:
        args = event.get("args", {})
        if event.get("cat") != "Node" or "op_name" not in args:
            continue
        per_op[args["op_name"]] += float(event.get("dur", 0))
        if args.get("provider") == "CPUExecutionProvider":
            on_cpu.add(f"{event.get('name', '?').removesuffix('_kernel_time')} ({args['op_name']})")
    total = sum(per_op.values()) or 1.0
    shares = {op: t / total for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])}
    return shares, sorted(on_cpu)


def profile_main(config: ServerConfig, batches: int, batch_size: int) -> int:
    """Run ORT's profiler over a few batches; print op-type time shares and CPU fallbacks."""
    from clipserve.backends import ort
    from clipserve.backends.base import ExecutorSpec
    from clipserve.backends.device import select_device
    from clipserve.backends.registry import resolve_devices
    from clipserve.errors import StartupError
    from clipserve.inference.model import load_model

    backend = config.backend.backend
    if backend not in ("ort-cpu", "ort-cuda", "ort-trt"):
        raise StartupError("clipserve profile: --backend must be ort-cpu, ort-cuda or ort-trt")
    device = resolve_devices(config.backend.gpus, backend)[0]
    select_device(device)  # before any CUDA call: --gpus 1 must not touch GPU 0
    model = load_model(config.model)
    executor = ort.create(model, ExecutorSpec.from_config(config), device, profiling=True)
    h, w = model.preprocess.size
    rng = np.random.default_rng(0)
    for _ in range(batches):
        executor.run(rng.integers(0, 256, (batch_size, h, w, 3), dtype=np.uint8))
    trace = Path(executor.end_profiling())
    shares, on_cpu = summarise_profile(json.loads(trace.read_text()))
    print(f"{backend} on {device}, {batches} batches of {batch_size}; trace: {trace}")
    print(f"{'op type':<28}share")
    for op, share in shares.items():
        print(f"{op:<28}{share:6.1%}")
    if backend != "ort-cpu":
        print(f"nodes on the CPU EP: {len(on_cpu)}")
        for node in on_cpu:
            print(f"  {node}")
    return 0


def add_subcommand_flags(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "export":
        parser.add_argument("--output", type=Path, help="directory to write (default: the cache)")
    elif command == "doctor":
        parser.add_argument("--json", action="store_true", help="one JSON document")
    else:
        parser.add_argument("--batches", type=int, default=5)
        parser.add_argument("--batch-size", type=int, default=8)
