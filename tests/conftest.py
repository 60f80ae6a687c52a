"""Shared fixtures: a tiny open_clip model, checkpoints written here, real uvicorn servers. The
functions the tests share are in tests/helpers.py."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clipserve.loadgen.procs import TINY_CONFIG
from tests.helpers import RunningServer, make_config, running, write_checkpoint

# Every server the tests start, in this process or as `clipserve` subprocesses (which inherit
# the environment), leaves gRPC off unless a test gives it a free port: two servers at once
# (or a developer's own on 8001) must not fight for Triton's default port.
os.environ["CLIPSERVE_GRPC_PORT"] = "0"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_config(model_dir: Path) -> Path:
    path = model_dir / "tiny-clip.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


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


@pytest.fixture(scope="module")
def tiny_loaded(tiny_config: Path, tiny_checkpoint: Path) -> Any:
    """The same weights as clipserve loads them (a LoadedModel), once per test module."""
    from clipserve.inference.model import load_model

    return load_model(make_config(tiny_config, tiny_checkpoint).model)


@pytest.fixture
def serve(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[Callable[..., RunningServer]]:
    """serve(**flag_overrides) → a running server; all are stopped at the end of the test."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> RunningServer:
            return stack.enter_context(
                running(make_config(tiny_config, tiny_checkpoint, **overrides))
            )

        yield start


@pytest.fixture(scope="module")
def module_server(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[RunningServer]:
    """One tiny-model server for a whole test module (protocol suites), 8 items per request."""
    with running(make_config(tiny_config, tiny_checkpoint, max_items_per_request=8)) as s:
        yield s


@pytest.fixture
def host_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows `crops_numpy` brought to the host with --decode gpu (the real function, counted)."""
    import clipserve.inference.gpu_decode as gpu_decode

    real = gpu_decode.crops_numpy
    copied: list[int] = []

    def counted(batch: Any) -> Any:
        copied.append(len(batch.ok))
        return real(batch)

    monkeypatch.setattr(gpu_decode, "crops_numpy", counted)
    return copied
