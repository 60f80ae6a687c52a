"""The Hub checked before --pretrained weights are asked of it: an unreachable Hub fails the
start in seconds with one line that says so (not after ~46 s of retries), and the Hub's log
records reach the server's own handler once (JSON under --log-format json)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clipserve.inference.hub import unreachable
from clipserve.loadgen.procs import free_port


def test_unreachable_says_why_and_a_listening_host_is_reachable() -> None:
    closed = free_port()
    why = unreachable(f"http://127.0.0.1:{closed}", timeout_s=2)
    assert why is not None and "refused" in why.lower()
    assert unreachable("no-scheme-or-host") is not None
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert unreachable(f"http://127.0.0.1:{listening.getsockname()[1]}") is None


@pytest.mark.slow  # ~10 s: a process importing open_clip
def test_an_unreachable_hub_fails_the_start_in_seconds(tmp_path: Path) -> None:
    proxies = ("HF_", "HTTP", "http", "ALL_PROXY", "all_proxy")  # behind one: no check made
    env = {k: v for k, v in os.environ.items() if not k.startswith(proxies)}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HOME=str(tmp_path / "hf"))
    cmd = [sys.executable, "-m", "clipserve", "--model", "ViT-B-32", "--port", str(free_port())]
    cmd += ["--pretrained", "laion2b_s34b_b79k", "--grpc-port", "0", "--log-format", "json"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr[-2000:]
    assert took < 30, took  # ViT-B-32's build is most of it; the retries took ~46 s more
    *records, last = out.stderr.strip().splitlines()
    assert last.startswith("clipserve: error: --pretrained laion2b_s34b_b79k:"), last
    assert "the Hub cannot be reached" in last and "refused" in last.lower()
    messages = [json.loads(line)["message"] for line in records]  # JSON only, before the end
    assert any("cannot be reached" in m and "local cache only" in m for m in messages)


@pytest.mark.slow  # ~10 s: a process importing open_clip
def test_the_hubs_records_go_to_the_servers_handler_once() -> None:
    script = (
        "import logging, open_clip\n"
        "from clipserve.logs import configure_logging\n"
        "from clipserve.inference.hub import route_hub_logs\n"
        "configure_logging('info', fmt='json')\n"
        "route_hub_logs()\n"
        "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "Retrying" in line]
    assert len(lines) == 1, out.stderr
    assert json.loads(lines[0])["logger"] == "huggingface_hub.utils._http"
