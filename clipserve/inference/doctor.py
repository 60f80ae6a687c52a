"""`clipserve doctor`: what the server would run on here, with the same flags, and why not
otherwise. For the first minutes on a new host: versions, driver and devices, each ONNX Runtime
provider and the real reason one cannot load (its own error, captured from the library's
stderr), TensorRT and nvJPEG, /dev/shm, the open-file limit, the front ends' accept queues
(`--workers N`), cores. Nothing is served and no model is loaded; the exit status is 1 when the
backend and devices given cannot run.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import resource
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from clipserve import __version__
from clipserve.backends.device import nvidia_device_files, torch_cuda_reason
from clipserve.config import ServerConfig
from clipserve.errors import StartupError

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
_MARK = {OK: "ok  ", WARN: "warn", FAIL: "FAIL", INFO: "    "}


@dataclass(frozen=True)
class Finding:
    section: str
    name: str
    status: str  # ok, warn, fail, info
    detail: str


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def captured_stderr() -> Iterator[io.StringIO]:
    """What C libraries write to fd 2 meanwhile (ONNX Runtime logs why a provider failed to
    load there, not in an exception)."""
    text = io.StringIO()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.write(sink.read().decode(errors="replace"))


def _host(config: ServerConfig) -> Iterator[Finding]:
    from clipserve.http.connections import fd_budget

    yield Finding("host", "clipserve", INFO, __version__)
    yield Finding("host", "python", INFO, f"{platform.python_version()} on {platform.platform()}")
    yield Finding("host", "cores", INFO, f"{len(os.sched_getaffinity(0))} usable")
    try:
        shm = os.statvfs("/dev/shm")
        size, free = shm.f_blocks * shm.f_frsize, shm.f_bavail * shm.f_frsize
        status = OK if free >= 64 << 20 else WARN  # a few slot files and regions
        yield Finding("host", "/dev/shm", status, f"{size >> 20} MiB, {free >> 20} MiB free")
    except OSError as e:
        yield Finding("host", "/dev/shm", WARN, f"unusable ({e.strerror}): slots go to /tmp")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = fd_budget(config.http.max_connections)
    fits = hard == resource.RLIM_INFINITY or hard >= need
    detail = (
        f"soft {soft}, hard {hard}; --max-connections {config.http.max_connections} needs {need}"
    )
    yield Finding("host", "open files", OK if fits else FAIL, detail)
    if config.http.workers > 1:
        yield _accept_queues(config.http.reuse_port)


MIGRATE_REQ = Path("/proc/sys/net/ipv4/tcp_migrate_req")
_RESET = "connections queued on a front end that dies are reset"


def _accept_queues(reuse_port: bool) -> Finding:
    """--workers N: one shared accept queue, or one per front end (--reuse-port), where the
    kernel's tcp_migrate_req decides what happens to a dead front end's queued connections."""
    if not reuse_port:
        detail = "one shared by the front ends; --reuse-port spreads connections over them"
        return Finding("host", "accept queues", INFO, detail)
    try:
        migrate = MIGRATE_REQ.read_text().strip()
    except OSError:
        detail = "one per front end; no net.ipv4.tcp_migrate_req (Linux 5.14+): "
        return Finding("host", "accept queues", INFO, detail + _RESET)
    if migrate == "1":
        detail = "one per front end; tcp_migrate_req 1: a dead one's queue goes to the others"
        return Finding("host", "accept queues", OK, detail)
    detail = f"one per front end; net.ipv4.tcp_migrate_req {migrate}: {_RESET} (set it to 1)"
    return Finding("host", "accept queues", WARN, detail)


def _torch() -> Iterator[Finding]:
    import torch

    cuda = torch.version.cuda or "none (CPU build)"
    yield Finding("torch", "torch", INFO, f"{torch.__version__}, CUDA {cuda}")
    driver = Path("/proc/driver/nvidia/version")
    if driver.exists():
        yield Finding("torch", "driver", INFO, driver.read_text().splitlines()[0])
    reason = torch_cuda_reason()
    if reason is not None:
        yield Finding("torch", "CUDA devices", WARN if nvidia_device_files() else INFO, reason)
        return
    cudnn_lib = torch.backends.cudnn
    cudnn = cudnn_lib.version() if cudnn_lib.is_available() else None  # type: ignore[no-untyped-call]
    yield Finding("torch", "cuDNN", INFO, str(cudnn))
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        detail = f"{props.name}, {props.total_memory >> 20} MiB, sm_{props.major}{props.minor}"
        yield Finding("torch", f"cuda:{i}", OK, detail)


def _tiny_onnx() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "doctor", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    serialized: bytes = model.SerializeToString()
    return serialized


def provider_reason(provider: str) -> str | None:
    """Why ONNX Runtime cannot run `provider` here (None: a session ran on it); the library's
    own message where it logs one."""
    import onnxruntime as ort

    if provider not in ort.get_available_providers():
        return "not in this onnxruntime build"
    options = ort.SessionOptions()
    options.log_severity_level = 1  # warnings: where a provider's load failure is reported
    # Its Python layer also prints a fallback banner to stdout: kept out of the report.
    with captured_stderr() as err, contextlib.redirect_stdout(io.StringIO()):
        try:
            session = ort.InferenceSession(_tiny_onnx(), options, providers=[provider])
            used = session.get_providers()
        except Exception as e:
            return _short(str(e).splitlines()[0])
    if provider in used:
        return None
    lines = [line for line in err.getvalue().splitlines() if "rror" in line or "fail" in line]
    return _short(lines[0]) if lines else "fell back to the CPU without a reason"


def _short(message: str) -> str:
    """ONNX Runtime's load failure without its source location: the library and the error."""
    if "Failed to load library" in message and "with error:" in message:
        library = message.split("Failed to load library", 1)[1].split(" with error:")[0].strip()
        error = message.split("with error:", 1)[1].strip()
        return f"cannot load {Path(library).name}: {error}"
    return message.split("] ", 1)[-1][:400]


def _onnxruntime() -> Iterator[Finding]:
    try:
        import onnxruntime as ort
    except ImportError as e:
        yield Finding("onnxruntime", "onnxruntime", FAIL, f"cannot be imported ({e})")
        return
    yield Finding("onnxruntime", "onnxruntime", INFO, ort.__version__)
    for provider in ("CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"):
        reason = provider_reason(provider)
        yield Finding("onnxruntime", provider, OK if reason is None else INFO, reason or "runs")
    from clipserve.backends.ort import tensorrt_libraries_present

    trt = _version("tensorrt") or _version("tensorrt-cu13") or _version("tensorrt-cu12")
    present = tensorrt_libraries_present()
    detail = f"libraries {'found' if present else 'not found'}" + (
        f", tensorrt {trt}" if trt else ""
    )
    yield Finding("onnxruntime", "TensorRT", OK if present else INFO, detail)


def _nvjpeg() -> Iterator[Finding]:
    import torch

    version = _version("torchvision")
    if version is None:
        yield Finding("decode", "nvJPEG", INFO, "torchvision is not installed")
        return
    if not torch.cuda.is_available():
        yield Finding("decode", "nvJPEG", INFO, f"torchvision {version}; needs a CUDA device")
        return
    from PIL import Image
    from torchvision.io import decode_jpeg

    jpeg = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 200)).save(jpeg, "JPEG")
    try:
        data = torch.frombuffer(bytearray(jpeg.getvalue()), dtype=torch.uint8)
        decode_jpeg(data, device="cuda:0")
        yield Finding("decode", "nvJPEG", OK, f"torchvision {version}: decodes on cuda:0")
    except Exception as e:
        yield Finding("decode", "nvJPEG", WARN, f"torchvision {version}: {str(e).splitlines()[0]}")


def _serving(config: ServerConfig) -> Iterator[Finding]:
    """The decision the server makes with these flags: devices, then a backend on each."""
    from clipserve.backends.registry import backend_candidates, resolve_devices, unavailable_reason

    backend, gpus = config.backend.backend, config.backend.gpus
    try:
        devices = resolve_devices(gpus, backend)
    except StartupError as e:
        yield Finding("serving", "--gpus " + gpus, FAIL, str(e))
        return
    if gpus.replace(" ", "") == "auto" and devices == ["cpu"] and nvidia_device_files():
        reason = torch_cuda_reason() or "unknown"
        yield Finding(
            "serving",
            "--gpus auto",
            WARN,
            f"serves on the CPU although NVIDIA device files exist: {reason}",
        )
    for device in devices:
        try:
            candidates = backend_candidates(backend, device)
        except StartupError as e:
            yield Finding("serving", device, FAIL, str(e))
            continue
        reasons = {c: unavailable_reason(c, device) for c in candidates}
        runnable = [c for c, r in reasons.items() if r is None]
        if runnable:
            yield Finding(
                "serving", device, OK, f"--backend {backend}: would serve with {runnable[0]}"
            )
        else:
            why = "; ".join(f"{c}: {r}" for c, r in reasons.items())
            yield Finding("serving", device, FAIL, f"--backend {backend} cannot run: {why}")


SECTIONS: tuple[Callable[[ServerConfig], Iterator[Finding]], ...] = (
    _host,
    lambda config: _torch(),
    lambda config: _onnxruntime(),
    lambda config: _nvjpeg(),
    _serving,
)


def examine(config: ServerConfig) -> list[Finding]:
    return [finding for section in SECTIONS for finding in section(config)]


def doctor_main(config: ServerConfig, as_json: bool) -> int:
    findings = examine(config)
    failed = any(f.status == FAIL for f in findings)
    if as_json:
        doc: dict[str, Any] = {"ok": not failed, "findings": [asdict(f) for f in findings]}
        print(json.dumps(doc, indent=2))
    else:
        section = ""
        for f in findings:
            if f.section != section:
                section = f.section
                print(f"\n{section}")
            print(f"  {_MARK[f.status]}  {f.name}: {f.detail}")
        print("\n" + ("cannot serve with these flags" if failed else "can serve with these flags"))
    return 1 if failed else 0
