"""The executor sections: the offline sweep over batch sizes of each FP16 executor this host can
build (torch eager, torch.compile, cuda-graphs, ort-cuda, ort-trt): the engine_fp16 target."""

from __future__ import annotations

import contextlib
from typing import Any

from bench.executors import executor_flags
from bench.gpu_check.plan import Emit, Plan


def executor_variants(plan: Plan) -> list[str]:
    if not plan.cuda:
        return ["torch"]
    variants = ["torch+fp16", "torch+fp16+compile", "cuda-graphs+fp16"]
    with contextlib.suppress(ImportError):
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        if "CUDAExecutionProvider" in providers:
            variants.append("ort-cuda+fp16")
        if "TensorrtExecutionProvider" in providers:  # fails, recorded, without TensorRT's libs
            variants.append("ort-trt+fp16")
    return variants


def section_executor(plan: Plan, emit: Emit, variant: str) -> dict[str, Any]:
    from clipserve.loadgen.offline import measure_executor

    model = {"model": plan.model, "pretrained": "none", "gpus": plan.gpus}
    flags = executor_flags(model, variant, plan.sizes)
    min_time_s = 0.1 if plan.quick else 0.5
    result = measure_executor(flags, plan.sizes, min_time_s=min_time_s, min_runs=3)
    best = max(result["rows"], key=lambda r: r["images_per_s"])
    return {**result, "best_images_per_s": best["images_per_s"], "best_batch": best["batch"]}
