"""Shared fixtures: a tiny open_clip model, checkpoints written here, real uvicorn servers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image
from prometheus_client import CollectorRegistry

from clipserve.config import ServerConfig, load_config
from clipserve.http.app import create_app
from clipserve.http.pipeline import Pipeline
from clipserve.http.server import build_uvicorn_config
from clipserve.loadgen.procs import TINY_CONFIG, clipserve_process


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_config(model_dir: Path) -> Path:
    path = model_dir / "tiny-clip.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


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


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_config: Path, model_dir: Path) -> Path:
    return write_checkpoint(tiny_config, model_dir / "tiny.pt", seed=1234)


@pytest.fixture(scope="session")
def tiny_model(tiny_config: Path, tiny_checkpoint: Path) -> Any:
    """The same weights, loaded directly with open_clip: the reference for parity checks."""
    import open_clip

    open_clip.add_model_config(tiny_config)
    model = open_clip.create_model(tiny_config.stem, pretrained=None)
    open_clip.load_checkpoint(model, str(tiny_checkpoint))
    return model.eval()


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
    }
    flags.update({k: v if isinstance(v, list) else str(v) for k, v in overrides.items()})
    return load_config(flags, environ={})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class RunningServer:
    url: str
    app: Any
    config: ServerConfig

    @property
    def state(self) -> Pipeline:
        return self.app.state.server  # type: ignore[no-any-return]


@contextlib.contextmanager
def running(config: ServerConfig) -> Iterator[RunningServer]:
    """Real uvicorn on a free loopback port, in a thread of this process."""
    app = create_app(config, registry=CollectorRegistry())
    # The CLI's own uvicorn settings (connection limits included), on a free port.
    server = uvicorn.Server(
        build_uvicorn_config(app, config.http, host="127.0.0.1", port=free_port(),
                             log_level="warning", timeout_graceful_shutdown=5)
    )  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{server.config.port}", app, config)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def serve(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[Callable[..., RunningServer]]:
    """serve(**flag_overrides) → a running server; all are stopped at the end of the test."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> RunningServer:
            return stack.enter_context(
                running(make_config(tiny_config, tiny_checkpoint, **overrides))
            )

        yield start


def png_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def random_pixels(seed: int, size: int = 224) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def reference_embedding(model: Any, pixels: np.ndarray, normalize: bool = True) -> np.ndarray:
    """What open_clip itself gives for these exact pixels, normalised as the server does."""
    import open_clip

    from clipserve.backends.base import normalise_numpy
    from clipserve.inference.preprocess import PreprocessSpec

    spec = PreprocessSpec.from_open_clip(open_clip.get_model_preprocess_cfg(model))
    x = torch.from_numpy(normalise_numpy(pixels[None], spec))
    with torch.inference_mode():
        out = model.encode_image(x, normalize=normalize)
    return out[0].numpy()


@contextlib.contextmanager
def cli_server(args: list[str], log_path: Path) -> Iterator[tuple[Any, str]]:
    """`clipserve ARGS` in a subprocess, its output in `log_path`; yields (process, url) once
    /readyz answers 200, and stops it at the end if it is still running."""
    with log_path.open("w") as log, clipserve_process(args, startup_s=90, stdout=log) as served:
        yield served


@pytest.fixture(scope="module")
def module_server(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[RunningServer]:
    """One tiny-model server for a whole test module (protocol suites), 8 items per request."""
    with running(make_config(tiny_config, tiny_checkpoint, max_items_per_request=8)) as s:
        yield s


async def until(condition: Callable[[], bool]) -> None:
    """Wait for the server to reach a state (polled; the test's clock is not the server's)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never reached the state the test waits for")
