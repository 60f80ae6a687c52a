"""Lines any client can make the server write, one per bad request (uvicorn's parser and upgrade
warnings, the multipart parser's): at most one of each per interval, in a real server's log."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import httpx

from clipserve.logs import ClientNoise
from tests.helpers import cli_server

BURST = 20


def _record(name: str, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, None)


def test_one_line_per_interval_and_a_count_of_the_rest() -> None:
    noise = ClientNoise(interval_s=0.2)
    invalid = "Invalid HTTP request received."
    assert noise.filter(_record("uvicorn.error", invalid))
    assert not any(noise.filter(_record("uvicorn.error", invalid)) for _ in range(5))
    assert noise.filter(_record("uvicorn.error", "Application startup complete."))  # not noise
    time.sleep(0.25)
    later = _record("uvicorn.error", invalid)
    assert noise.filter(later) and later.getMessage() == f"{invalid} (5 more like it not logged)"
    assert noise.filter(_record("python_multipart.multipart", "Found invalid character"))
    assert not noise.filter(_record("python_multipart.multipart", "Skipping data after last"))


def _send(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):  # the answer, to the end: the server has logged by then
            pass


def test_a_burst_of_bad_requests_logs_each_kind_once(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    args = ["--model", str(tiny_config), "--checkpoint", str(tiny_checkpoint)]
    args += ["--backend", "fake", "--log-level", "info", "--grpc-port", "0"]
    with cli_server(args, log) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        upgrade = (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        )
        bad_part = (
            b'--b\r\nContent-Disposition: form-data; name="f"\r\nX\rY: z\r\n\r\nabc\r\n--b--\r\n'
        )
        for _ in range(BURST):
            _send(port, b"GARBAGE \x00\x01 / HTTP/1.1\r\n\r\n")
            _send(port, upgrade)
            r = httpx.post(
                url + "/embed",
                content=bad_part,
                headers={"content-type": "multipart/form-data; boundary=b"},
            )
            assert r.status_code == 400, r.text
        assert httpx.get(url + "/healthz").status_code == 200
    text = log.read_text()
    assert text.count("Invalid HTTP request received.") == 1, text[-3000:]
    # A request that offers an upgrade is served as HTTP/1.1 (http/guarded.py): nothing to log.
    assert "Unsupported upgrade" not in text and "WebSocket" not in text, text[-3000:]
    assert text.count("python_multipart.multipart") == 1, text[-3000:]
