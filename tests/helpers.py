"""What the test modules share (fixtures live in conftest.py): waits on state, the tiny model's
config and reference embeddings, servers on free loopback ports and requests to them, images."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import io
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image
from prometheus_client import CollectorRegistry

from clipserve.backends.fake import FakeExecutor, FakeTextExecutor
from clipserve.batching import Batcher
from clipserve.config import ServerConfig, load_config
from clipserve.http.app import create_app
from clipserve.http.pipeline import Pipeline
from clipserve.http.server import build_uvicorn_config
from clipserve.inference.preprocess import PreprocessSpec
from clipserve.loadgen.images import encode
from clipserve.loadgen.procs import clipserve_process, free_port
from clipserve.logs import ACCESS_LOGGER

T = TypeVar("T")
PNG = {"Content-Type": "image/png"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# ---- waiting on state, not on the clock ---------------------------------------------------------


def _describe(condition: Callable[..., object]) -> str:
    try:
        return " ".join(inspect.getsource(condition).split())
    except (OSError, TypeError):
        return repr(condition)


def until(
    condition: Callable[[], T], timeout_s: float = 10, what: str = "", poll_s: float = 0.02
) -> T:
    """Poll `condition` until it returns something truthy, and return that. After `timeout_s`,
    fail naming `what` (or the condition's source): the state never came."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what or _describe(condition)}")
        time.sleep(poll_s)
    return result


async def until_async(
    condition: Callable[[], T], timeout_s: float = 10, what: str = "", poll_s: float = 0.01
) -> T:
    """`until` inside an event loop: the loop runs on (servers in it too) while this waits."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what or _describe(condition)}")
        await asyncio.sleep(poll_s)
    return result


async def until_checked(
    check: Callable[[], Awaitable[bool]],
    timeout_s: float = 10,
    what: str = "",
    poll_s: float = 0.02,
) -> None:
    """`until_async` for a condition that must itself await (a request to the server)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what or _describe(check)}")
        await asyncio.sleep(poll_s)


def tower_idle(batcher: Batcher) -> bool:
    """Nothing queued and no worker holding a batch: whatever was going to run has run."""
    return batcher.depth() == 0 and all(w.running is None for w in batcher.workers)


# ---- the tiny model ---------------------------------------------------------------------------


def write_checkpoint(config_path: Path, out: Path, seed: int) -> Path:
    import open_clip

    open_clip.add_model_config(config_path)
    torch.manual_seed(seed)
    model = open_clip.create_model(config_path.stem, pretrained=None)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out))
    else:
        torch.save(model.state_dict(), out)
    return out


def make_config(tiny_config: Path, tiny_checkpoint: Path, **overrides: Any) -> ServerConfig:
    """A ServerConfig for the tiny model; overrides use flag names (max_batch_size=4, ...)."""
    flags: dict[str, Any] = {
        "model": str(tiny_config),
        "checkpoint": str(tiny_checkpoint),
        "backend": "torch",
        "gpus": "cpu",
        "threads": "1",
        "decode_workers": "1",
        "cache_dir": str(tiny_checkpoint.parent / "cache"),
        # Tests count computations and send the same image twice: the embedding cache is on
        # only where a test asks for it (tests/http/test_cache.py).
        "cache_mb": "0",
        "grpc_port": "0",  # off unless a test gives it a free port (tests/conftest.py)
    }
    flags.update({k: v if isinstance(v, list) else str(v) for k, v in overrides.items()})
    return load_config(flags, environ={})


def reference_embedding(model: Any, pixels: np.ndarray, normalize: bool = True) -> np.ndarray:
    """What open_clip itself gives for these exact pixels, normalised as the server does."""
    import open_clip

    from clipserve.backends.base import normalise_numpy

    spec = PreprocessSpec.from_open_clip(open_clip.get_model_preprocess_cfg(model))
    x = torch.from_numpy(normalise_numpy(pixels[None], spec))
    with torch.inference_mode():
        out = model.encode_image(x, normalize=normalize)
    return out[0].numpy()


def visual_reference(loaded: Any, x: np.ndarray) -> np.ndarray:
    """PyTorch FP32's image features for a uint8 NHWC batch (a LoadedModel's own tower)."""
    from clipserve.backends.base import normalise_numpy

    with torch.inference_mode():
        return loaded.module.visual(torch.from_numpy(normalise_numpy(x, loaded.preprocess))).numpy()


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest cosine between matching rows of a and b."""
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


# ---- servers ----------------------------------------------------------------------------------

Serve = Callable[..., "RunningServer"]


@dataclasses.dataclass
class RunningServer:
    url: str
    app: Any
    config: ServerConfig

    @property
    def state(self) -> Pipeline:
        return self.app.state.pipeline  # type: ignore[no-any-return]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def uvicorn_thread(server: uvicorn.Server, startup_s: float = 60) -> Iterator[str]:
    """`server` in a daemon thread of this process; yields its URL once it listens, and stops it
    when the block ends."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started or not thread.is_alive(), startup_s, "the server listening")
    if not server.started:
        raise RuntimeError("test server did not start")
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def running(config: ServerConfig) -> Iterator[RunningServer]:
    """Real uvicorn on a free loopback port, in a thread of this process."""
    app = create_app(config, registry=CollectorRegistry())
    # The CLI's own uvicorn settings (connection limits included), on a free port.
    server = uvicorn.Server(
        build_uvicorn_config(
            app,
            config.http,
            host="127.0.0.1",
            port=free_port(),
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    with uvicorn_thread(server) as url:
        served = RunningServer(url, app, config)
        _forget_timed_batches(served)
        yield served


def _forget_timed_batches(server: RunningServer) -> None:
    """Tests count what their requests ran: the executors' timed batches after warm-up
    (`Runtime.warm_costs`, `text_warm_costs`) are forgotten once the server is up."""
    runtime = server.state.runtime
    for executor in [*runtime.executors, *runtime.text_executors]:
        if isinstance(executor, FakeExecutor | FakeTextExecutor):
            executor.forget_runs()


@contextlib.contextmanager
def cli_server(args: list[str], log_path: Path) -> Iterator[tuple[Any, str]]:
    """`clipserve ARGS` in a subprocess, its output in `log_path`; yields (process, url) once
    /readyz answers 200, and stops it at the end if it is still running."""
    with log_path.open("w") as log, clipserve_process(args, startup_s=90, stdout=log) as served:
        yield served


def run_clipserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m clipserve ARGS` to completion, offline (no model hub), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "clipserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def metric(server: RunningServer, name: str) -> float:
    """One sample of /metrics, by its name with labels as the text shows them."""
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def post(
    server: RunningServer, body: bytes, headers: dict[str, str] | None = None, path: str = "/embed"
) -> httpx.Response:
    """POST `body` (a PNG unless `headers` say otherwise) to the server's `path`."""
    return httpx.post(
        server.url + path, content=body, headers=PNG if headers is None else headers, timeout=60
    )


def embed_image(server: RunningServer, image: bytes) -> np.ndarray:
    """/embed's answer for one PNG."""
    r = httpx.post(server.url + "/embed", content=image, headers=PNG, timeout=30)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embedding"], np.float32)


def embed_text(server: RunningServer, texts: list[str]) -> np.ndarray:
    """/embed/text's answer for these texts."""
    r = httpx.post(server.url + "/embed/text", json={"texts": texts}, timeout=30)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], np.float32)


def model_name(server: RunningServer) -> str:
    return server.state.runtime.model.name


# ---- images -----------------------------------------------------------------------------------

# A small model input for batcher and worker tests over the fake executor.
SPEC_32 = PreprocessSpec((32, 32), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def marked_array(mark: int) -> np.ndarray:
    """A 32x32 RGB array (SPEC_32's size) whose top-left red value is `mark`; distinct content
    per mark."""
    a = np.full((32, 32, 3), mark, dtype=np.uint8)
    a[1:, 1:, 1] = (mark * 7) % 256
    return a


def png_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def random_pixels(seed: int, size: int = 224) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def marked_png(mark: int, seed: int = 0) -> bytes:
    """A 224x224 PNG (decoded without resampling) whose top-left red value is `mark`."""
    pixels = random_pixels(seed)
    pixels[0, 0, 0] = mark
    return png_bytes(pixels)


def corrupt_huffman(data: bytes) -> bytes:
    """A JPEG whose header opens (admission passes it) but whose Huffman table is bogus: every
    decoder refuses its data."""
    at = data.find(b"\xff\xc4")
    return data[: at + 5] + b"\xff" * 16 + data[at + 21 :]


def with_orientation(
    image: Image.Image | bytes, orientation: int, fmt: str = "JPEG", **params: object
) -> bytes:
    """`image` (or an encoded one, opened) encoded as `fmt` with this EXIF Orientation tag."""
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, fmt, exif=exif.tobytes(), **params)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    """One PNG chunk: length, type, body, CRC."""
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


# ---- KServe v2 -------------------------------------------------------------------------------


def bytes_input(
    elements: list[bytes], binary: bool, name: str = "image", shape: list[int] | None = None
) -> Any:
    """A tritonclient BYTES input holding `elements` (reshaped to `shape` if given)."""
    import tritonclient.http as triton

    array = np.array(elements, dtype=np.object_)
    if shape is not None:
        array = array.reshape(shape)
    inp = triton.InferInput(name, list(array.shape), "BYTES")
    return inp.set_data_from_numpy(array, binary_data=binary)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with the openssl binary."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl binary")
    cert, key = directory / "cert.pem", directory / "key.pem"
    args = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    args += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    subprocess.run(["openssl", *args], check=True, capture_output=True)
    return cert, key


@contextlib.contextmanager
def access_lines() -> Iterator[list[logging.LogRecord]]:
    """The access log's records written meanwhile, at INFO whatever the logging setup (each
    record's `fields` holds the line's request id, route, status and so on)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger(ACCESS_LOGGER)
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
