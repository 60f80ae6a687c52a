"""Correctness on real hardware: device selection, fatal device errors, `--backend auto` falling
through backends that cannot start, and the text tower's own stream.

Everything a CPU can check runs here; the rest is `gpu`-marked and skips with a reason where no
CUDA device is present. Executor-level checks that need a broken CUDA context run in a
subprocess, since a sticky CUDA error poisons the whole process.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clipserve.backends import device as dev
from clipserve.backends import registry
from clipserve.backends.base import ExecutorInfo
from clipserve.backends.onnx_export import import_onnxruntime
from clipserve.backends.registry import BACKENDS, BackendEntry, Implementation, backend_candidates
from clipserve.errors import ExecutorFatal, StartupError
from clipserve.inference.runtime import build_runtime, device_thread
from tests.helpers import make_config, min_cosine, needs_cuda

REPO = Path(__file__).resolve().parents[2]
# ONNX Runtime's own exception types (imported so that its environment warnings are logged).
_ort_errors = import_onnxruntime().capi.onnxruntime_pybind11_state
Fail, RuntimeException = _ort_errors.Fail, _ort_errors.RuntimeException
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
ORT_PREFIX = "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running {op} "
ORT_PREFIX += "node. Name:'/visual/{op}' Status Message: "

# ---------------------------------------------------------------------------------------------
# Which thread talks to which device


def test_cuda_index_of_every_device_string() -> None:
    assert [dev.cuda_index(d) for d in ("cuda:0", "cuda:1", "cuda:12", "cuda")] == [0, 1, 12, 0]
    assert [dev.cuda_index(d) for d in ("cpu", "sim:0", "sim:3")] == [None, None, None]


@pytest.mark.parametrize("device", ["cpu", "sim:0", "sim:3"])
def test_device_thread_is_initialised_for_its_device(device: str) -> None:
    thread = device_thread(device)
    try:
        assert thread.submit(dev.selected_device).result() == device
    finally:
        thread.shutdown()
    assert dev.selected_device() is None  # the caller's thread is left alone


def test_runtime_builds_every_device_on_a_thread_selected_for_it(
    tiny_config: Path, tiny_checkpoint: Path
) -> None:
    config = make_config(tiny_config, tiny_checkpoint, backend="fake", gpus="0,2", max_batch_size=2)
    runtime = build_runtime(config)
    try:
        assert [ex.info.device for ex in runtime.executors] == ["sim:0", "sim:2"]
        bound = [thread.submit(dev.selected_device).result() for thread in runtime.threads]
        assert bound == ["sim:0", "sim:2"]
    finally:
        runtime.close()


CPU_PATH_SCRIPT = """
import sys
from pathlib import Path
import numpy as np
import torch
from clipserve.inference.runtime import build_runtime
from tests.helpers import make_config

config = make_config(Path(sys.argv[1]), Path(sys.argv[2]), backend="{backend}", gpus="cpu",
                     max_batch_size=2, cache_dir=sys.argv[3])
rt = build_runtime(config)
rt.threads[0].submit(rt.executors[0].run, np.zeros((2, 224, 224, 3), np.uint8)).result()
rt.threads[0].submit(rt.text_executors[0].run, rt.tokenize(["a cat"])).result()
print("memory", [ex.memory() for ex in rt.executors])
rt.close()
print("cuda initialised:", torch.cuda.is_initialized())
"""


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("ort-cpu", marks=pytest.mark.slow)],  # ORT's: CI runs it
)
def test_cpu_path_never_initialises_cuda(
    backend: str, tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """On a GPU host `--gpus cpu` must not create a CUDA context (here, with no driver, any CUDA
    call would raise instead)."""
    script = CPU_PATH_SCRIPT.format(backend=backend)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_config), str(tiny_checkpoint), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "memory [None]" in done.stdout
    assert "cuda initialised: False" in done.stdout


@pytest.mark.gpu
@needs_cuda
def test_every_cuda_device_thread_selects_its_device() -> None:
    for index in range(torch.cuda.device_count()):
        thread = device_thread(f"cuda:{index}")
        try:
            assert thread.submit(torch.cuda.current_device).result() == index
        finally:
            thread.shutdown()


GPU1_SCRIPT = """
import ctypes, os, sys
from pathlib import Path
import numpy as np
from clipserve.errors import StartupError
from clipserve.inference.runtime import build_runtime
from tests.helpers import make_config

config = make_config(Path(sys.argv[1]), Path(sys.argv[2]), backend=sys.argv[4], gpus="1",
                     max_batch_size=4, cache_dir=sys.argv[3])
try:
    rt = build_runtime(config)
except StartupError as e:
    print("cannot start:", e)
    os._exit(0)
rt.threads[0].submit(rt.executors[0].run, np.zeros((3, 224, 224, 3), np.uint8)).result()
rt.threads[0].submit(rt.text_executors[0].run, rt.tokenize(["a cat", "a dog"])).result()
print("memory", [ex.memory() for ex in rt.executors])  # scrape-time call, from this thread
libcuda = ctypes.CDLL("libcuda.so.1")
assert libcuda.cuInit(0) == 0
device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert libcuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert libcuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
print("gpu0 context active:", active.value)
os._exit(0)
"""


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("backend", ["torch", "cuda-graphs", "ort-cuda"])
def test_gpus_1_never_touches_gpu_0(
    backend: str, tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Build, warm up (graph capture included), run both towers and read memory for `--gpus 1`;
    then GPU 0's primary context must never have been created in this process."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            GPU1_SCRIPT,
            str(tiny_config),
            str(tiny_checkpoint),
            str(tmp_path),
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if "cannot start:" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert "gpu0 context active: 0" in done.stdout, done.stdout


# ---------------------------------------------------------------------------------------------
# Fatal device errors vs errors that fail one batch

ACCELERATOR_ERROR: Any = getattr(torch, "AcceleratorError", RuntimeError)
FATAL = [
    ACCELERATOR_ERROR(
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors "
        "might be asynchronously reported at some other API call"
    ),
    RuntimeError("CUDA error: an illegal memory access was encountered"),  # torch < 2.8
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA error: uncorrectable ECC error encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: misaligned address"),
    RuntimeError("CUDA error: unknown error"),  # what a GPU that fell off the bus reports
    RuntimeError("CUDA driver error: unknown error"),
    RuntimeError("CUDA error: no CUDA-capable device is detected"),
    RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, ...)`"),
    Fail(
        ORT_PREFIX.format(op="Mul") + "CUDA error cudaErrorIllegalAddress:an illegal memory "
        "access was encountered"
    ),
    RuntimeException(
        ORT_PREFIX.format(op="Conv") + "CUDA failure 700: an illegal memory access "
        "was encountered ; GPU=0 ; hostname=h100 ; file=cuda_call.cc ; line=129 ; "
        "expr=cudaStreamSynchronize(stream);"
    ),
    Fail(
        ORT_PREFIX.format(op="MatMul") + "CUBLAS failure 13: CUBLAS_STATUS_EXECUTION_FAILED ; "
        "GPU=0 ; hostname=h100 ; expr=cublasGemmHelper(...);"
    ),
    Fail(
        ORT_PREFIX.format(op="Gemm") + "CUDA error cudaErrorECCUncorrectable:uncorrectable ECC "
        "error encountered"
    ),
]
NOT_FATAL = [
    torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.06 GiB is free."
    ),
    ACCELERATOR_ERROR("CUDA error: out of memory"),
    RuntimeError("CUDA error: out of memory"),
    RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    ACCELERATOR_ERROR("CUDA error: too many resources requested for launch"),
    RuntimeError("CUDA error: invalid configuration argument"),
    RuntimeException(
        ORT_PREFIX.format(op="MatMul") + "Failed to allocate memory for requested "
        "buffer of size 1073741824"
    ),
    Fail(ORT_PREFIX.format(op="Conv") + "CUDA error cudaErrorMemoryAllocation:out of memory"),
    Fail(
        ORT_PREFIX.format(op="Add") + "Available memory of 0 is smaller than requested bytes of "
        "524288"
    ),
    RuntimeError("CUDA out of memory (simulated on sim:0)"),  # the fake backend's
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (3x64 and 32x64)"),
    ValueError("batch of shape (1, 100, 100, 3) does not fit input (224, 224, 3)"),
]


@pytest.mark.parametrize("exc", FATAL, ids=lambda e: f"{type(e).__name__}:{str(e)[-40:]}")
def test_fatal_device_errors(exc: Exception) -> None:
    assert dev.is_fatal_device_error(exc)
    with pytest.raises(ExecutorFatal) as raised, dev.fatal_device_errors("cuda:3"):
        raise exc
    assert raised.value.__cause__ is exc and str(raised.value).startswith("cuda:3: ")


@pytest.mark.parametrize("exc", NOT_FATAL, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_errors_that_fail_one_batch_pass_through(exc: Exception) -> None:
    """Out-of-memory above all: the batcher splits the batch and the halves may fit."""
    assert not dev.is_fatal_device_error(exc)
    with pytest.raises(type(exc)) as raised, dev.fatal_device_errors("cuda:0"):
        raise exc
    assert raised.value is exc


def test_out_of_memory_is_recognised() -> None:
    assert all(dev.is_out_of_memory(e) for e in NOT_FATAL[:5])
    assert not any(dev.is_out_of_memory(e) for e in FATAL)


def test_classification_works_without_torch_accelerator_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.AcceleratorError exists from PyTorch 2.8 only; earlier versions raise RuntimeError
    with the same message, and looking the class up must not fail."""
    monkeypatch.delattr(torch, "AcceleratorError", raising=False)
    assert dev.is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access"))
    assert not dev.is_fatal_device_error(RuntimeError("CUDA error: out of memory"))


@pytest.mark.skipif(not hasattr(torch, "AcceleratorError"), reason="torch < 2.8")
def test_any_accelerator_error_but_oom_is_fatal() -> None:
    error = torch.AcceleratorError("operation not permitted when stream is capturing")
    assert dev.is_fatal_device_error(error)
    assert not dev.is_fatal_device_error(RuntimeError(str(error)))


POISON_SCRIPT = """
import os, sys
from pathlib import Path
import numpy as np
import torch
from clipserve.backends.base import ExecutorSpec
from clipserve.backends.registry import create_executor
from clipserve.backends.text_torch import TextExecutor
from clipserve.errors import ExecutorFatal, StartupError
from clipserve.inference.model import load_model
from tests.helpers import make_config

name = sys.argv[4]
config = make_config(Path(sys.argv[1]), Path(sys.argv[2]), backend="torch" if name == "text"
                     else name, gpus="0", max_batch_size=4, cache_dir=sys.argv[3])
model = load_model(config.model)
torch.cuda.set_device(0)
try:
    spec = ExecutorSpec.from_config(config)
    ex = TextExecutor(model, "cuda:0") if name == "text" else create_executor(model, spec, "cuda:0")
except StartupError as e:
    print("cannot start:", e)
    os._exit(0)
ex.warmup([1, 2, 4])
x = (np.zeros((2, 77), np.int64) if name == "text" else np.zeros((2, 224, 224, 3), np.uint8))
ex.run(x)
try:  # a device-side assert: sticky, every later CUDA call in this process fails
    t = torch.zeros(4, device="cuda:0")
    t[torch.tensor([10], device="cuda:0")] = 1.0
    torch.cuda.synchronize()
except Exception as e:
    print("poisoned:", type(e).__name__)
try:
    ex.run(x)
    print("RESULT ran")
except ExecutorFatal as e:
    print("RESULT fatal:", e)
except Exception as e:
    print("RESULT other:", type(e).__name__, e)
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["torch", "cuda-graphs", "ort-cuda", "ort-trt", "text"])
def test_a_broken_cuda_context_is_fatal_in_every_gpu_executor(
    name: str, tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            POISON_SCRIPT,
            str(tiny_config),
            str(tiny_checkpoint),
            str(tmp_path),
            name,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if "cannot start:" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert "RESULT fatal:" in done.stdout, (done.stdout, done.stderr[-3000:])


# ---------------------------------------------------------------------------------------------
# --backend auto moves on when a backend fails to start

closed: list[str] = []


class WarmupFails:
    """Builds, then fails its warm-up as a TensorRT engine build or a graph capture might."""

    def __init__(self, device: str) -> None:
        self.info = ExecutorInfo("warmup-fails", device, "fp32", (224, 224), 32)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        raise RuntimeError("TensorRT EP failed to create engine from network")

    def run(self, batch: np.ndarray) -> np.ndarray:
        raise AssertionError("never served")

    def memory(self) -> int | None:
        return None

    def close(self) -> None:
        closed.append(self.info.device)


def create_refusing(model: Any, spec: Any, device: str) -> Any:
    raise StartupError("--backend refuses: libnvinfer.so.10: cannot open shared object file")


def create_warmup_fails(model: Any, spec: Any, device: str) -> WarmupFails:
    return WarmupFails(device)


def anywhere(backend: str, device: str) -> None:
    return None


def nowhere(backend: str, device: str) -> str:
    return f"not available on {device}"


def registered(create: Any, unavailable_reason: Any) -> Any:
    return lambda: Implementation(create, unavailable_reason)


@pytest.fixture
def auto_chain(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Registers backends that fail to start, like any other backend, and an auto order that
    tries them before torch."""
    entries = {
        "refuses": BackendEntry(registered(create_refusing, anywhere), None),
        "warmup-fails": BackendEntry(registered(create_warmup_fails, anywhere), None),
        "gpu-only": BackendEntry(registered(create_refusing, anywhere), None, gpu_only=True),
        "unavailable": BackendEntry(registered(create_refusing, nowhere), None),
    }
    for name, entry in entries.items():
        monkeypatch.setitem(BACKENDS, name, entry)

    def order(*names: str) -> None:
        monkeypatch.setattr(registry, "AUTO_ORDER", names)

    closed.clear()
    return order


def test_auto_skips_backends_that_fail_to_start(
    auto_chain: Any, tiny_config: Path, tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auto_chain("gpu-only", "unavailable", "refuses", "warmup-fails", "torch", "ort-cpu")
    caplog.set_level(logging.INFO, logger="clipserve")
    config = make_config(tiny_config, tiny_checkpoint, backend="auto", gpus="cpu", max_batch_size=2)
    runtime = build_runtime(config)
    try:
        assert runtime.backend == "torch"
        assert [ex.info.backend for ex in runtime.executors] == ["torch"]
    finally:
        runtime.close()
    assert closed == ["cpu"]  # the executor whose warm-up failed was closed
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--backend auto")]
    assert lines == [
        "--backend auto: skipping gpu-only on cpu: needs a CUDA device",
        "--backend auto: skipping unavailable on cpu: not available on cpu",
        "--backend auto: refuses did not start, trying the next: --backend refuses: "
        "libnvinfer.so.10: cannot open shared object file",
        "--backend auto: warmup-fails did not start, trying the next: RuntimeError: TensorRT EP "
        "failed to create engine from network",
        "--backend auto picked torch for cpu",
    ]


def test_auto_fails_with_every_reason_when_nothing_starts(
    auto_chain: Any, tiny_config: Path, tiny_checkpoint: Path
) -> None:
    auto_chain("refuses", "warmup-fails")
    config = make_config(tiny_config, tiny_checkpoint, backend="auto", gpus="cpu", max_batch_size=2)
    with pytest.raises(
        StartupError,
        match=r"no backend started on cpu \(refuses: .*libnvinfer"
        r".*; warmup-fails: RuntimeError: TensorRT EP",
    ):
        build_runtime(config)


def test_an_explicit_backend_that_fails_to_start_is_not_replaced(
    auto_chain: Any, tiny_config: Path, tiny_checkpoint: Path
) -> None:
    config = make_config(tiny_config, tiny_checkpoint, backend="refuses", gpus="cpu")
    with pytest.raises(StartupError, match="libnvinfer"):
        build_runtime(config)


def test_auto_candidates_on_this_host() -> None:
    assert backend_candidates("auto", "cpu") == ["torch", "ort-cpu"]
    assert backend_candidates("ort-cpu", "cpu") == ["ort-cpu"]


# ---------------------------------------------------------------------------------------------
# The text tower's own stream


@pytest.mark.gpu
@needs_cuda
def test_text_tower_runs_on_its_own_stream(
    tiny_config: Path, tiny_checkpoint: Path, tiny_model: Any
) -> None:
    from clipserve.backends.text_torch import TextExecutor
    from clipserve.inference.model import load_model

    model = load_model(make_config(tiny_config, tiny_checkpoint).model)
    text = TextExecutor(model, "cuda:0", "fp16")
    try:
        assert text.stream is not None
        assert text.stream != torch.cuda.default_stream(0)
        tokens = model.tokenizer(["a cat", "a dog on a mat"]).numpy().astype(np.int64)
        got = text.run(tokens)
        with torch.inference_mode():
            want = tiny_model.encode_text(torch.from_numpy(tokens)).numpy()
        assert min_cosine(got, want) >= 0.999
    finally:
        text.close()


def test_text_tower_thread_is_shared_on_cpu_and_separate_on_cuda() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from clipserve.inference.runtime import text_thread

    image = ThreadPoolExecutor(1)
    try:
        assert text_thread("cpu", image) is image  # one OpenMP team on the CPU
        assert text_thread("sim:0", image) is image
        own = text_thread("cuda:1", image)  # a thread of its own; nothing runs on it here
        assert own is not image
        own.shutdown()
    finally:
        image.shutdown()
