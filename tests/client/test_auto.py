"""Auto mode: the service when it is ready, the model in-process when nothing listens, and a
run that finishes in-process when the service is killed halfway through it."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from clipserve.client import Client
from clipserve.loadgen.procs import free_port
from tests.helpers import RunningServer, cli_server, marked_png, until

IMAGES = [marked_png(m, seed=m) for m in range(40)]


def client_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "clipserve.client" and r.levelno >= logging.WARNING
    ]


def answered(url: str) -> int:
    """/embed requests the server has answered 200 so far."""
    text = httpx.get(url + "/metrics").text
    found = re.search(
        r'^clipserve_requests_total\{route="/embed",status="200"\} (\S+)$', text, re.M
    )
    return int(float(found.group(1))) if found else 0


def test_auto_uses_the_service_when_it_is_ready(
    module_server: RunningServer, local_args: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with Client(module_server.url, mode="auto", **local_args) as c:
        assert c.mode_in_use == "remote"
        assert c.embed_images(IMAGES[:3]).shape == (3, 32)
    assert client_warnings(caplog) == []


def test_auto_falls_back_to_local_when_nothing_listens(
    local_args: dict[str, Any], local_client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, mode="auto", **local_args) as c:
        assert c.mode_in_use == "local"
        vectors = c.embed_images(IMAGES[:5])
        assert c.info()["model"] == local_client.info()["model"]
    np.testing.assert_allclose(vectors, local_client.embed_images(IMAGES[:5]), atol=1e-6)
    (warning,) = client_warnings(caplog)
    assert url in warning and "embedding locally" in warning


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_auto_finishes_locally_when_the_server_dies_mid_run(
    tiny_config: Path,
    tiny_checkpoint: Path,
    local_args: dict[str, Any],
    local_client: Client,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The fake executor (its own embeddings, 250 ms a request) over the same model identity:
    # rows from the service and rows computed here are told apart by their values.
    flags = ["--model", str(tiny_config), "--checkpoint", str(tiny_checkpoint)]
    flags += ["--backend", "fake", "--backend-option", "latency_ms=250"]
    flags += ["--max-items-per-request", "4"]  # 10 requests, one at a time: 2.5 s in all
    done: dict[str, np.ndarray] = {}
    with cli_server(flags, tmp_path / "server.log") as (proc, url):
        c = Client(url, mode="auto", concurrency=1, retries=1, **local_args)
        with c:
            assert c.mode_in_use == "remote"
            run = threading.Thread(target=lambda: done.update(vectors=c.embed_images(IMAGES)))
            run.start()
            until(lambda: answered(url) >= 2, what="two requests answered")
            proc.kill()
            run.join(60)
    assert c.mode_in_use == "local"
    vectors = done["vectors"]
    assert vectors.shape == (40, 32) and np.isfinite(vectors).all()
    local = np.isclose(vectors, local_client.embed_images(IMAGES), atol=1e-5).all(axis=1)
    assert not local[:8].any()  # the two batches answered before the kill: the service's
    assert local[-4:].all()  # the last batch: computed here
    (warning,) = client_warnings(caplog)
    assert "went away" in warning and "finishing locally" in warning
