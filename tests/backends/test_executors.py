"""Every registered executor that can run here honours the Executor contract and matches PyTorch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clipserve.backends import cuda_graphs, ort
from clipserve.backends.base import Executor, ExecutorSpec, normalise_numpy, warmup_sizes
from clipserve.backends.onnx_export import cached_export, meta_path
from clipserve.backends.registry import BACKENDS, backend_candidates, create_executor
from clipserve.errors import StartupError
from clipserve.inference.commands import summarise_profile
from clipserve.inference.model import load_model
from tests.helpers import (
    make_config,
    min_cosine,
    needs_cuda,
    run_clipserve,
    visual_reference,
)

RUNNABLE_HERE = ["torch", "ort-cpu", "fake"]
GPU_BACKENDS = ["torch", "cuda-graphs", "ort-cuda", "ort-trt"]
# Stated tolerances against PyTorch FP32, cosine per embedding:
FP32_MIN_COSINE = 0.99999
FP16_MIN_COSINE = 0.999


@pytest.fixture
def config_for(tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path) -> Any:
    def build(**overrides: Any) -> Any:
        overrides.setdefault("cache_dir", str(tmp_path / "cache"))
        return make_config(tiny_config, tiny_checkpoint, **overrides)

    return build


@pytest.fixture
def spec_for(config_for: Any) -> Any:
    """spec_for(backend=..., **flags) → the ExecutorSpec the runtime would build."""

    def build(**overrides: Any) -> ExecutorSpec:
        return ExecutorSpec.from_config(config_for(**overrides))

    return build


def batch(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", RUNNABLE_HERE)
def test_conformance(name: str, tiny_loaded: Any, spec_for: Any) -> None:
    executor: Executor = create_executor(tiny_loaded, spec_for(backend=name), "cpu")
    try:
        assert executor.info.backend == name
        assert executor.info.embed_dim == 32 and executor.info.input_size == (224, 224)
        executor.warmup(warmup_sizes(4))
        x = batch(3)
        out = executor.run(x)
        assert out.shape == (3, 32) and out.dtype == np.float32
        np.testing.assert_allclose(executor.run(x[1:2]), out[1:2], rtol=1e-4, atol=1e-5)
        floats = normalise_numpy(x, tiny_loaded.preprocess)  # the second input kind
        np.testing.assert_allclose(executor.run(floats), out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(executor.run(floats.astype(np.float16)), out, atol=5e-2)
        with pytest.raises(ValueError):
            executor.run(np.zeros((1, 100, 100, 3), dtype=np.uint8))
        assert executor.memory() is None  # CPU: nothing to report
    finally:
        executor.close()


@pytest.mark.parametrize("name", ["torch", "ort-cpu"])
def test_fp32_parity_with_pytorch(name: str, tiny_loaded: Any, spec_for: Any) -> None:
    executor = create_executor(tiny_loaded, spec_for(backend=name), "cpu")
    x = batch(8, seed=3)
    out, want = executor.run(x), visual_reference(tiny_loaded, x)
    assert min_cosine(out, want) >= FP32_MIN_COSINE
    np.testing.assert_allclose(out, want, atol=1e-4)


def test_export_is_cached_by_weights_and_reused(
    tiny_loaded: Any, config_for: Any, tmp_path: Path
) -> None:
    first = cached_export(tiny_loaded, tmp_path, "fp32")
    meta = json.loads(meta_path(first.directory, "fp32").read_text())
    assert meta["min_cosine_vs_torch"] >= FP32_MIN_COSINE
    assert meta["versions"]["onnxruntime"] and meta["versions"]["torch"]
    mtime = first.image.stat().st_mtime_ns
    again = cached_export(tiny_loaded, tmp_path, "fp32")
    assert again.image == first.image and again.image.stat().st_mtime_ns == mtime  # reused
    other = load_model(config_for(pretrained="none", checkpoint="none").model)  # new weights
    assert other.visual_digest != tiny_loaded.visual_digest
    assert cached_export(other, tmp_path, "fp32").directory != first.directory


def test_fp16_export_stays_within_fp16_tolerance(tiny_loaded: Any, tmp_path: Path) -> None:
    exported = cached_export(tiny_loaded, tmp_path, "fp16")
    meta = json.loads(meta_path(exported.directory, "fp16").read_text())
    assert meta["precision"] == "fp16" and meta["min_cosine_vs_torch"] >= FP16_MIN_COSINE


@pytest.mark.parametrize("name", ["ort-cuda", "ort-trt"])
def test_gpu_provider_that_cannot_load_is_refused(
    name: str, tiny_loaded: Any, tmp_path: Path
) -> None:
    """onnxruntime-gpu lists these providers here, with no GPU; the session falls back to the
    CPU. The executor must notice and refuse rather than serve on the CPU under a GPU name."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the provider may well load")
    exported = cached_export(tiny_loaded, tmp_path, "fp32")
    with pytest.raises(StartupError, match=r"could not use \w+ExecutionProvider.*clipserve\["):
        ort.OrtExecutor(exported, tiny_loaded, name, "cuda:0", "fp16", max_batch_size=4, threads=1)
    # A failed TensorRT build keeps no engine folder, complete or not (a .lock file may stay).
    assert [p.name for p in (exported.directory / "trt").glob("*-fp16-b*") if p.is_dir()] == []


@pytest.mark.parametrize("name", ["ort-cuda", "ort-trt", "cuda-graphs"])
def test_gpu_backends_refuse_a_cpu_device(name: str, tiny_loaded: Any, spec_for: Any) -> None:
    with pytest.raises(StartupError, match="needs a CUDA device"):
        create_executor(tiny_loaded, spec_for(backend=name), "cpu")


@pytest.mark.parametrize(("name", "precision"), [("torch", "fp16"), ("ort-cpu", "fp16")])
def test_unsupported_precision_fails_naming_the_flag(
    name: str, precision: str, tiny_loaded: Any, spec_for: Any
) -> None:
    with pytest.raises(StartupError, match=f"--precision {precision}"):
        create_executor(tiny_loaded, spec_for(backend=name, precision=precision), "cpu")


def trt_cache(**changes: Any) -> ort.TrtCache:
    fields: dict[str, Any] = {
        "trt_version": "10.13.3.9",
        "capability": (9, 0),
        "precision": "fp16",
        "size": (224, 224),
        "profile": (1, 32, 32),
    }
    fields.update(changes)
    return ort.TrtCache(**fields)


def test_trt_options_build_one_profile_for_every_batch_size(tmp_path: Path) -> None:
    opts = ort.trt_provider_options("cuda:1", trt_cache(profile=ort.trt_profile(32)), tmp_path)
    assert opts["device_id"] == "1"
    assert opts["trt_fp16_enable"] == "True"
    assert opts["trt_profile_min_shapes"] == "pixel_values:1x3x224x224"
    assert opts["trt_profile_opt_shapes"] == "pixel_values:32x3x224x224"
    assert opts["trt_profile_max_shapes"] == "pixel_values:32x3x224x224"
    assert opts["trt_engine_cache_enable"] == "True"
    assert opts["trt_engine_cache_path"] == str(
        tmp_path / "trt10.13.3.9-sm90-fp16-b1-32-32-224x224"
    )
    assert opts["trt_timing_cache_path"] == str(tmp_path / "trt10.13.3.9-sm90")
    fp32 = ort.trt_provider_options(
        "cuda:0", trt_cache(precision="fp32", size=(336, 336)), tmp_path
    )
    assert fp32["trt_fp16_enable"] == "False"
    assert fp32["trt_profile_max_shapes"] == "pixel_values:32x3x336x336"


def test_trt_engine_cache_is_keyed_by_everything_an_engine_depends_on(tmp_path: Path) -> None:
    """Two configurations never share an engine directory: ORT names engines by graph only."""
    base = trt_cache()
    variants = [
        trt_cache(trt_version="10.14.1.48"),
        trt_cache(capability=(8, 9)),
        trt_cache(capability=(12, 0)),
        trt_cache(precision="fp32"),
        trt_cache(size=(336, 336)),
        trt_cache(profile=(1, 64, 64)),
        trt_cache(profile=(1, 16, 32)),
        trt_cache(profile=(8, 32, 32)),
    ]
    dirs = {c.engine_dir(tmp_path) for c in [base, *variants]}
    assert len(dirs) == 1 + len(variants)
    assert trt_cache().engine_dir(tmp_path) == base.engine_dir(tmp_path)  # stable: reused
    # Timing caches depend on TensorRT and the GPU only: shared across precision and shapes.
    assert base.timing_dir(tmp_path) == trt_cache(precision="fp32", profile=(1, 8, 8)).timing_dir(
        tmp_path
    )
    assert base.timing_dir(tmp_path) != trt_cache(capability=(8, 9)).timing_dir(tmp_path)
    assert base.timing_dir(tmp_path) != trt_cache(trt_version="10.14").timing_dir(tmp_path)
    odd = trt_cache(trt_version="10.x/../../etc", capability=None)  # never leaves the root
    assert odd.engine_dir(tmp_path).parent == tmp_path and "/" not in odd.key
    assert "smunknown" in odd.key


def test_tensorrt_version_is_a_stable_string() -> None:
    version = ort.tensorrt_version()
    assert version and version == ort.tensorrt_version()


def test_ort_cuda_never_searches_cudnn_algorithms_exhaustively() -> None:
    """EXHAUSTIVE (ORT's default) benchmarks every algorithm per new input shape, on the request
    path for batch sizes warm-up did not cover."""
    cuda = ort.cuda_provider_options("cuda:2")
    assert cuda["cudnn_conv_algo_search"] in ("HEURISTIC", "DEFAULT")
    assert cuda["device_id"] == "2"


def test_provider_lists_put_the_wanted_provider_first(tmp_path: Path) -> None:
    trt = ort.trt_provider_options("cuda:0", trt_cache(), tmp_path)

    def names(backend: str) -> list[str]:
        return [name for name, _ in ort.providers_for(backend, "cuda:0", trt)]

    assert names("ort-trt") == [ort.TRT, ort.CUDA, ort.CPU]
    assert names("ort-cuda") == [ort.CUDA, ort.CPU]
    assert names("ort-cpu") == [ort.CPU]
    cuda = ort.cuda_provider_options("cuda:2")
    assert cuda["device_id"] == "2" and cuda["arena_extend_strategy"] == "kSameAsRequested"


def test_cuda_graph_buckets() -> None:
    assert cuda_graphs.parse_buckets("", 32) == [1, 2, 4, 8, 16, 32]
    assert cuda_graphs.parse_buckets("", 24) == [1, 2, 4, 8, 16, 24]
    assert cuda_graphs.parse_buckets("8, 1,32", 32) == [1, 8, 32]
    assert cuda_graphs.parse_buckets("1,16,64", 32) == [1, 16, 32]  # capped at the largest batch
    with pytest.raises(StartupError, match="--batch-buckets"):
        cuda_graphs.parse_buckets("1,8", 32)
    buckets = [1, 8, 32]
    assert [cuda_graphs.bucket_for(n, buckets) for n in (1, 2, 8, 9, 32)] == [1, 8, 8, 32, 32]
    with pytest.raises(ValueError):
        cuda_graphs.bucket_for(33, buckets)


def test_auto_picks_torch_on_cpu_and_unknown_names_fail() -> None:
    assert backend_candidates("auto", "cpu")[0] == "torch"  # faster than ort-cpu here (bench/)
    with pytest.raises(StartupError, match="unknown backend"):
        backend_candidates("nope", "cpu")
    assert {"torch", "cuda-graphs", "ort-cpu", "ort-cuda", "ort-trt", "fake"} <= set(BACKENDS)


def test_profile_summary_shares_and_cpu_fallbacks() -> None:
    events = [
        {
            "cat": "Node",
            "name": "mm_kernel_time",
            "dur": 30,
            "args": {"op_name": "MatMul", "provider": "CUDAExecutionProvider"},
        },
        {
            "cat": "Node",
            "name": "mm2_kernel_time",
            "dur": 50,
            "args": {"op_name": "MatMul", "provider": "CUDAExecutionProvider"},
        },
        {
            "cat": "Node",
            "name": "shape_kernel_time",
            "dur": 20,
            "args": {"op_name": "Shape", "provider": "CPUExecutionProvider"},
        },
        {"cat": "Session", "name": "model_run", "dur": 500, "args": {}},
    ]
    shares, on_cpu = summarise_profile(events)
    assert shares == {"MatMul": pytest.approx(0.8), "Shape": pytest.approx(0.2)}
    assert on_cpu == ["shape (Shape)"]


@pytest.mark.slow  # two CLI subprocesses exporting ONNX: ~20 s
def test_export_and_profile_commands(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    base = [
        "--model",
        str(tiny_config),
        "--checkpoint",
        str(tiny_checkpoint),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--log-level",
        "warning",
    ]

    exported = run_clipserve("export", *base, "--output", str(tmp_path / "out"), timeout=300)
    assert exported.returncode == 0, exported.stderr
    assert "checker    passed" in exported.stdout
    cosine = float(exported.stdout.split("min cosine ")[1].split()[0])
    assert cosine >= FP32_MIN_COSINE
    assert (tmp_path / "out" / "image-fp32.onnx").is_file()
    profiled = run_clipserve(
        "profile", *base, "--backend", "ort-cpu", "--gpus", "cpu", "--batches", "2", timeout=300
    )
    assert profiled.returncode == 0, profiled.stderr
    shares = [float(line.split()[-1].rstrip("%")) for line in profiled.stdout.splitlines()[2:]]
    assert shares and abs(sum(shares) - 100) < 1.0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_parity(name: str, tiny_loaded: Any, spec_for: Any) -> None:
    try:
        executor = create_executor(tiny_loaded, spec_for(backend=name, gpus="0"), "cuda:0")
    except StartupError as e:  # a provider or library this host lacks: named in the reason
        pytest.skip(f"{name} cannot start here: {e}")
    try:
        executor.warmup(warmup_sizes(8))
        for n in (1, 3, 8):
            x = batch(n, seed=n)
            assert min_cosine(executor.run(x), visual_reference(tiny_loaded, x)) >= FP16_MIN_COSINE
        assert (executor.memory() or 0) > 0
    finally:
        executor.close()
