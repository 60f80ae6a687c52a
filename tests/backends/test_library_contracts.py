"""Contracts with the installed torch, torchvision and onnxruntime(-gpu): the signatures, names
and behaviour the GPU code relies on, checked here on the CPU so that an upgrade that breaks one
fails CI instead of a user's first GPU run. Each test names the code that relies on it.

The CUDA calls cannot run here; their signatures can, and argument names and order are what an
upgrade breaks silently (a renamed keyword raises only when the line runs, on a GPU)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clipserve.backends.ort import cuda_provider_options, trt_provider_options


def params(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


# ---------------------------------------------------------------------------------------------
# torchvision (inference/gpu_decode.py)


def test_decode_jpeg_takes_a_list_and_a_device_and_fails_the_list_as_one() -> None:
    """gpu_decode.DeviceDecoder: `decode_jpeg(list, mode=RGB, device=...)` returns one CHW uint8
    tensor per input; a list with one bad image raises RuntimeError (the halving relies on it)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from clipserve.loadgen.images import jpeg

    assert params(decode_jpeg)[:3] == ["input", "mode", "device"]
    good = [torch.frombuffer(bytearray(jpeg(64, 48, seed=i)), dtype=torch.uint8) for i in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out = decode_jpeg(good, mode=ImageReadMode.RGB, device=torch.device("cpu"))
        assert isinstance(out, list) and [tuple(t.shape) for t in out] == [(3, 48, 64)] * 2
        assert all(t.dtype == torch.uint8 for t in out)
        bad = torch.frombuffer(bytearray(b"\xff\xd8\xff\xdb not a jpeg"), dtype=torch.uint8)
        with pytest.raises(RuntimeError):
            decode_jpeg([good[0], bad], mode=ImageReadMode.RGB, device=torch.device("cpu"))


def test_antialiased_interpolate_takes_uint8_on_the_cpu() -> None:
    """gpu_decode._resize: uint8 antialiased bicubic on the CPU (Pillow's kernel), float on CUDA."""
    x = torch.arange(2 * 3 * 40 * 30, dtype=torch.int64).remainder(256).to(torch.uint8)
    x = x.reshape(2, 3, 40, 30)
    kw: dict[str, Any] = {"mode": "bicubic", "align_corners": False, "antialias": True}
    small = torch.nn.functional.interpolate(x, size=(20, 15), **kw)
    assert small.dtype == torch.uint8 and tuple(small.shape) == (2, 3, 20, 15)
    as_float = torch.nn.functional.interpolate(x.float(), size=(20, 15), **kw)
    assert (as_float.round().clamp(0, 255) - small.float()).abs().max() <= 1


# ---------------------------------------------------------------------------------------------
# torch: streams, events, graphs, pinned memory (backends/torch_device.py, torch_eager.py,
# cuda_graphs.py, text_torch.py, inference/nvjpeg.py)


def test_stream_and_event_constructors() -> None:
    assert params(torch.cuda.Stream.__new__)[1:3] == ["device", "priority"]
    assert "blocking" in params(torch.cuda.Event.__new__)
    for name in ("wait_event", "wait_stream", "synchronize", "query", "record_event"):
        assert callable(getattr(torch.cuda.Stream, name)), name
    for name in ("record", "synchronize", "query", "wait", "elapsed_time"):
        assert callable(getattr(torch.cuda.Event, name)), name


def test_stream_context_and_current_stream() -> None:
    assert params(torch.cuda.stream) == ["stream"]
    assert params(torch.cuda.current_stream) == ["device"]
    assert params(torch.cuda.set_device) == ["device"]
    assert params(torch.cuda.mem_get_info) == ["device"]
    assert params(torch.cuda.memory_allocated) == ["device"]
    assert params(torch.cuda.get_device_capability) == ["device"]


def test_record_stream_and_pinned_copies() -> None:
    """torch_device.CudaDevice.keep (GPU decode's outputs, crops handed to an executor):
    `Tensor.record_stream(stream)`; CudaDevice.current: `torch.cuda.current_stream(device)`;
    `Stream.wait_stream`; staging: `pin_memory()`, `torch.empty(pin_memory=)`,
    `copy_(non_blocking=)`, `.to(non_blocking=)`."""
    assert callable(torch.Tensor.record_stream)
    assert params(torch.cuda.current_stream) == ["device"]
    assert params(torch.cuda.Stream.wait_stream)[1:] == ["stream"]
    assert "record_stream(stream)" in (torch.Tensor.record_stream.__doc__ or "")
    assert callable(torch.Tensor.pin_memory) and callable(torch.Tensor.is_pinned)
    x, y = torch.zeros(4), torch.ones(4)
    x.copy_(y, non_blocking=True)
    assert torch.equal(x, y) and torch.equal(y.to("cpu", non_blocking=True), y)
    assert "pin_memory" in (torch.empty.__doc__ or "")


def test_cuda_graph_capture_api() -> None:
    """torch_device.CudaDevice.capture: `torch.cuda.graph(graph, pool=, stream=)`,
    `CUDAGraph().replay()`, `graph_pool_handle()`."""
    assert params(torch.cuda.graph.__init__)[1:4] == ["cuda_graph", "pool", "stream"]
    assert callable(torch.cuda.CUDAGraph.replay)
    assert params(torch.cuda.graph_pool_handle) == []
    assert callable(torch.cuda.empty_cache)


def test_device_errors_have_the_types_device_py_tells_apart() -> None:
    """backends/device.py: OutOfMemoryError is a RuntimeError (the batcher splits on it);
    AcceleratorError (torch >= 2.8) marks a fatal device error."""
    assert issubclass(torch.cuda.OutOfMemoryError, RuntimeError)
    found = getattr(torch, "AcceleratorError", None)
    assert found is None or (isinstance(found, type) and issubclass(found, Exception))


def test_torch_compile_takes_dynamic() -> None:
    """torch_eager: `torch.compile(module, dynamic=True)`."""
    assert "dynamic" in params(torch.compile)


# ---------------------------------------------------------------------------------------------
# onnxruntime (backends/ort.py)


def test_iobinding_signatures_in_the_order_ort_py_calls_them() -> None:
    import onnxruntime as ort

    assert params(ort.IOBinding.bind_input)[1:] == [
        "name",
        "device_type",
        "device_id",
        "element_type",
        "shape",
        "buffer_ptr",
    ]
    assert params(ort.IOBinding.bind_output)[1:] == params(ort.IOBinding.bind_input)[1:]
    assert params(ort.IOBinding.bind_cpu_input)[1:] == ["name", "arr_on_cpu"]
    assert params(ort.InferenceSession.run_with_iobinding)[1:2] == ["iobinding"]
    assert params(ort.OrtValue.ortvalue_from_shape_and_type)[:4] == [
        "shape",
        "element_type",
        "device_type",
        "device_id",
    ]
    assert callable(ort.IOBinding.copy_outputs_to_cpu)


def test_iobinding_runs_with_the_arguments_ort_py_passes(tmp_path: Path) -> None:
    """The same calls as OrtExecutor._run, positional as there, on the CPU: a uint8 input bound
    from numpy, a preallocated output OrtValue bound by pointer, the result copied out."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["pixels"], ["x"], to=TensorProto.FLOAT)],
        "cast",
        [helper.make_tensor_value_info("pixels", TensorProto.UINT8, ["n", 3])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "cast.onnx"
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = ort.OrtValue.ortvalue_from_shape_and_type((4, 3), np.float32, "cpu", 0)
    binding = session.io_binding()
    binding.bind_cpu_input("pixels", np.arange(6, dtype=np.uint8).reshape(2, 3))
    binding.bind_output("x", "cpu", 0, np.float32, [2, 3], out.data_ptr())
    session.run_with_iobinding(binding)
    got = binding.copy_outputs_to_cpu()[0]
    assert got.dtype == np.float32 and got.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out.numpy()[:2].tolist() == got.tolist()  # written through the bound pointer


def _provider_library(name: str) -> bytes:
    import onnxruntime as ort

    path = Path(ort.__file__).parent / "capi" / f"libonnxruntime_providers_{name}.so"
    if not path.exists():
        pytest.skip(f"{path.name} is not installed (onnxruntime without the GPU providers)")
    return path.read_bytes()


def test_the_cuda_provider_knows_every_option_we_pass() -> None:
    """ORT's CUDA EP parses options by name; an unknown one fails session creation on a GPU.
    Each name (and enum value) must appear in the installed provider library."""
    library = _provider_library("cuda")
    for key, value in cuda_provider_options("cuda:1").items():
        assert key.encode() in library, key
        if not value.isdigit():
            assert value.encode() in library, value


def test_the_tensorrt_provider_knows_every_option_we_pass(tmp_path: Path) -> None:
    from clipserve.backends.ort import TrtCache

    library = _provider_library("tensorrt")
    cache = TrtCache("10.13", (9, 0), "fp16", (224, 224), (1, 8, 16))
    options = trt_provider_options("cuda:0", cache, tmp_path)
    assert options["trt_fp16_enable"] == "True"
    for key in options:
        assert key.encode() in library, key


def test_onnxruntime_gpu_lists_both_gpu_providers() -> None:
    """ort.py's PROVIDER names: what get_available_providers answers where the GPU build is."""
    import onnxruntime as ort

    from clipserve.backends.ort import CUDA, TRT

    _provider_library("cuda")
    assert {CUDA, TRT} <= set(ort.get_available_providers())
