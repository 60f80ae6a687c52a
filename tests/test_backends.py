"""Every registered executor that can run here honours the Executor contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clipserve.backends.base import Executor, normalise_numpy, warmup_sizes
from clipserve.backends.registry import BACKENDS, create_executor, resolve_backend
from clipserve.errors import StartupError
from clipserve.model import load_model
from tests.conftest import make_config

RUNNABLE_HERE = ["torch", "fake"]


@pytest.fixture(scope="module")
def loaded(tiny_config: Path, tiny_checkpoint: Path) -> Any:
    return load_model(make_config(tiny_config, tiny_checkpoint).model)


def batch(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", RUNNABLE_HERE)
def test_conformance(name: str, loaded: Any, tiny_config: Path, tiny_checkpoint: Path) -> None:
    config = make_config(tiny_config, tiny_checkpoint, backend=name)
    executor: Executor = create_executor(name, loaded, config, "cpu")
    try:
        assert executor.info.embed_dim == 32 and executor.info.input_size == (224, 224)
        executor.warmup(warmup_sizes(4))
        x = batch(3)
        out = executor.run(x)
        assert out.shape == (3, 32) and out.dtype == np.float32
        np.testing.assert_allclose(executor.run(x[1:2]), out[1:2], rtol=1e-4, atol=1e-5)
        floats = normalise_numpy(x, loaded.preprocess)  # the second input kind
        np.testing.assert_allclose(executor.run(floats), out, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError):
            executor.run(np.zeros((1, 100, 100, 3), dtype=np.uint8))
        assert executor.memory() is None  # CPU: nothing to report
    finally:
        executor.close()


def test_torch_matches_open_clip_directly(loaded: Any, tiny_config: Path, tiny_checkpoint: Path,
                                         tiny_model: Any) -> None:  # fmt: skip
    config = make_config(tiny_config, tiny_checkpoint)
    executor = create_executor("torch", loaded, config, "cpu")
    x = batch(4, seed=3)
    with torch.inference_mode():
        want = tiny_model.encode_image(torch.from_numpy(normalise_numpy(x, loaded.preprocess)))
    np.testing.assert_allclose(executor.run(x), want.numpy(), atol=1e-5, rtol=1e-5)


def test_fp16_on_cpu_is_refused(loaded: Any, tiny_config: Path, tiny_checkpoint: Path) -> None:
    config = make_config(tiny_config, tiny_checkpoint, precision="fp16")
    with pytest.raises(StartupError, match="--precision fp16"):
        create_executor("torch", loaded, config, "cpu")


def test_auto_picks_an_available_backend_and_unknown_names_fail() -> None:
    assert resolve_backend("auto", "cpu") in BACKENDS
    with pytest.raises(StartupError, match="unknown backend"):
        resolve_backend("nope", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_fp16_on_cuda_stays_close_to_fp32(loaded: Any, tiny_config: Path,
                                               tiny_checkpoint: Path) -> None:  # fmt: skip
    config = make_config(tiny_config, tiny_checkpoint, gpus="0")
    fp32 = create_executor("torch", loaded, make_config(tiny_config, tiny_checkpoint), "cpu")
    fp16 = create_executor("torch", loaded, config, "cuda:0")
    x = batch(8)
    a, b = fp32.run(x), fp16.run(x)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() >= 0.999
    assert (fp16.memory() or 0) > 0
