"""The self-check's text tower: canary texts, tokenised as served, through each text executor
against open_clip's `encode_text` in FP32 on the CPU, with the image tower's floor logic. A text
tower computing wrong numbers (as an FP16 overflow would) fails the check, logs a line naming
it, shows in /info and, under --self-check strict, keeps the server unready."""

from __future__ import annotations

import logging

import httpx
import numpy as np
import pytest

from clipserve.backends.text_torch import TextExecutor
from clipserve.inference.runtime import Runtime
from clipserve.inference.self_check import (
    CANARY_TEXTS,
    FLOORS,
    blocks_readiness,
    run_self_check,
)
from tests.helpers import Serve


def test_the_canary_texts_fill_the_context_once() -> None:
    """One text is cut to the context (77 tokens): every position of the tower is compared."""
    assert len(CANARY_TEXTS) == 4 and len(CANARY_TEXTS[-1].split()) > 77


def test_wrong_text_numbers_fail_and_strict_keeps_the_server_unready(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = TextExecutor.run

    def noisy(self: TextExecutor, batch: np.ndarray) -> np.ndarray:
        """Noise of 5% of each row's norm: cosine ~0.9988 to the right row."""
        out = run(self, batch)
        noise = np.random.default_rng(len(out)).standard_normal(out.shape)
        scale = 0.05 * np.linalg.norm(out, axis=1, keepdims=True) / out.shape[1] ** 0.5
        wrong: np.ndarray = (out + scale * noise).astype(np.float32)
        return wrong

    monkeypatch.setattr(TextExecutor, "run", noisy)  # served only: the reference is open_clip's
    with caplog.at_level(logging.INFO, logger="clipserve.inference.self_check"):
        server = serve(self_check="strict")
    assert httpx.get(server.url + "/readyz").status_code == 503
    check = httpx.get(server.url + "/info").json()["self_check"]
    assert check["status"] == "failed" and check["mode"] == "strict", check
    assert check["min_cosine"] >= FLOORS["fp32"]  # the image tower is right
    assert check["texts"] == 4 and check["text_floor"] == FLOORS["fp32"]
    assert 0.99 < check["text_min_cosine"] < FLOORS["fp32"]
    assert "canary images (floor 0.9999): passed" in caplog.text
    failed = "torch-text on cpu (fp32) vs torch-cpu-fp32: worst cosine"
    assert failed in caplog.text
    assert "canary texts, below the floor 0.9999: not ready" in caplog.text
    # warn reports the same and serves anyway.
    runtime = server.state.runtime
    assert isinstance(runtime, Runtime)  # in this process
    warned = run_self_check(runtime, "warn")
    assert warned["status"] == "failed" and not blocks_readiness(warned)
    assert "canary texts, below the floor 0.9999 (--self-check warn" in caplog.text
