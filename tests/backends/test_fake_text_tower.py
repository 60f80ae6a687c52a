"""The fake backend's text tower: deterministic embeddings without a model, and its failures
reaching exactly the text tower."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from clipserve.backends.base import ExecutorSpec
from clipserve.backends.fake import FakeTextExecutor
from clipserve.backends.registry import create_text_executor
from clipserve.errors import ExecutorFatal, StartupError
from tests.helpers import PNG, Serve, png_bytes, random_pixels


def fake_text(model: Any, *options: str) -> FakeTextExecutor:
    spec = ExecutorSpec("fake", options=dict(o.split("=", 1) for o in options))
    executor = create_text_executor(model, spec, "sim:0")
    assert isinstance(executor, FakeTextExecutor)
    return executor


def test_fake_text_tower_is_deterministic_and_tells_texts_apart(tiny_loaded: Any) -> None:
    tokens = tiny_loaded.tokenize(["a cat", "a dog", "", "a cat"])
    first, second = (
        fake_text(tiny_loaded),
        fake_text(tiny_loaded),
    )  # two instances, as two devices have
    out = first.run(tokens)
    assert out.shape == (4, 32) and out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_array_equal(out, second.run(tokens))
    np.testing.assert_array_equal(out[0], out[3])
    assert len({row.tobytes() for row in out[:3]}) == 3
    cheap = fake_text(tiny_loaded, "compute=0").run(tokens)  # a table row per text, still stable
    np.testing.assert_array_equal(cheap[0], cheap[3])
    assert first.info.backend == "fake-text" and first.info.device == "sim:0"
    with pytest.raises(ValueError, match="int64 tokens"):
        first.run(tokens.astype(np.int32))


def test_fake_text_markers_fail_poison_or_kill_their_batch(tiny_loaded: Any) -> None:
    executor = fake_text(tiny_loaded, "fail_text=oops", "nan_text=void", "fatal_text=boom")
    with pytest.raises(RuntimeError, match="simulated executor failure"):
        executor.run(tiny_loaded.tokenize(["a cat", "oops"]))
    out = executor.run(tiny_loaded.tokenize(["a cat", "void", "void here"]))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()
    with pytest.raises(ExecutorFatal):
        executor.run(tiny_loaded.tokenize(["boom"]))
    with pytest.raises(StartupError, match="no option"):
        fake_text(tiny_loaded, "fatal_txt=boom")


def test_other_backends_keep_the_pytorch_text_tower(tiny_loaded: Any) -> None:
    executor = create_text_executor(tiny_loaded, ExecutorSpec("torch"), "cpu")
    try:
        assert executor.info.backend == "torch-text"
    finally:
        executor.close()


def test_a_lost_text_device_stops_only_the_text_tower(serve: Serve) -> None:
    server = serve(backend="fake", gpus="0", backend_option=["fatal_text=boom"])
    runtime = server.state.runtime
    assert [ex.info.backend for ex in runtime.text_executors] == ["fake-text"]
    texts = ["a photo of a cat", "a diagram"]
    r = httpx.post(server.url + "/embed/text", json={"texts": texts}, timeout=30)
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["embeddings"], dtype=np.float32)
    want = fake_text(runtime.model).run(runtime.tokenize(texts))  # the fake, not the model
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    lost = httpx.post(server.url + "/embed/text", json={"texts": ["boom"]}, timeout=30)
    assert lost.status_code == 503 and lost.json()["error"]["code"] == "not_ready"
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 503
    assert ready.json()["workers"]["sim:0"] == "ok"
    assert ready.json()["workers"]["text:sim:0"].startswith("dead")
    health = httpx.get(server.url + "/healthz")
    assert health.status_code == 503
    assert health.json() == {"status": "failing", "reason": "text tower: no live worker"}
    again = httpx.post(server.url + "/embed/text", json={"texts": texts}, timeout=30)
    assert again.status_code == 503
    image = httpx.post(
        server.url + "/embed", content=png_bytes(random_pixels(1)), headers=PNG, timeout=30
    )
    assert image.status_code == 200 and len(image.json()["embedding"]) == 32
