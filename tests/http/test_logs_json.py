"""--log-format json: every line a JSON object, an access line per request, in every process."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.grpc as grpcclient

from clipserve.loadgen.procs import free_port
from tests.helpers import PNG, cli_server, marked_png

FIELDS = {"time", "level", "logger", "role", "message"}
ACCESS = {"request_id", "method", "route", "path", "status", "duration_ms", "items", "client"}


def _lines(log: Path) -> list[dict[str, Any]]:
    """Every line of the server's output as JSON (a line that is not fails the test)."""
    entries = []
    for number, line in enumerate(log.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            raise AssertionError(f"line {number} is not JSON: {line[:300]!r}") from None
        assert isinstance(entry, dict), line
        assert entry.keys() >= FIELDS, line
        moment = datetime.datetime.fromisoformat(entry["time"])
        assert entry["time"].endswith("Z") and moment.utcoffset() == datetime.timedelta(0), line
        entries.append(entry)
    return entries


def _access(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    lines = [e for e in entries if e["logger"] == "clipserve.access"]
    for line in lines:
        assert line.keys() >= ACCESS, line
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines), "one access line per request"
    return by_id


def _model_args(tiny_config: Path, tiny_checkpoint: Path) -> list[str]:
    return [
        "--model",
        str(tiny_config),
        "--checkpoint",
        str(tiny_checkpoint),
        "--backend",
        "fake",
        "--backend-option",
        "fail_pixel=7",
        "--log-format",
        "json",
        "--log-level",
        "info",
    ]


def test_one_process_writes_json_lines_and_an_access_line_per_request(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("alice:sk-alice-0123456789\n")
    grpc_port = free_port()
    args = [*_model_args(tiny_config, tiny_checkpoint), "--api-keys", str(keys)]
    args += ["--grpc-port", str(grpc_port)]
    alice = {"Authorization": "Bearer sk-alice-0123456789"}
    alice_grpc = {"authorization": "Bearer sk-alice-0123456789"}
    log = tmp_path / "server.log"
    sent = {  # request id -> (headers, body, the status it must get)
        "req-ok": ({**PNG, **alice}, marked_png(1), 200),
        "req-bad": ({**PNG, **alice}, b"not an image", 400),
        "req-nokey": (PNG, marked_png(2), 401),
        "req-fail": ({**PNG, **alice}, marked_png(7), 500),  # the fake executor raises
    }
    with cli_server(args, log) as (_, url), httpx.Client(base_url=url, timeout=60) as client:
        for rid, (headers, body, status) in sent.items():
            r = client.post("/embed", content=body, headers={**headers, "X-Request-Id": rid})
            assert r.status_code == status, (rid, r.text)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc:
            ready = grpc.is_server_ready(headers={"x-request-id": "grpc-ready", **alice_grpc})
            assert ready
    entries = _lines(log)  # the server has stopped: its last lines are written

    access = _access(entries)
    for rid, (_, _, status) in sent.items():
        line = access[rid]
        assert line["status"] == status, line
        # Refused before routing (no key), it is still labelled by its route.
        assert (line["method"], line["route"], line["path"]) == ("POST", "/embed", "/embed")
        assert line["client"].startswith("127.0.0.1:"), line
        assert line["duration_ms"] > 0, line
        assert line["level"] == "info" and line["role"] == "main", line
    assert access["req-ok"]["items"] == 1 and access["req-ok"]["key"] == "alice"
    assert access["req-bad"]["items"] == 1  # parsed: one image, which did not decode
    assert access["req-nokey"]["key"] is None
    route = "/inference.GRPCInferenceService/ServerReady"
    line = access["grpc-ready"]  # the same fields, from the gRPC door
    assert (line["method"], line["route"], line["path"], line["status"]) == (
        "GRPC",
        route,
        route,
        200,
    )
    assert line["client"] and line["duration_ms"] > 0 and line["items"] is None, line
    # The executor's failure, its traceback in the same object as its message.
    failures = [e for e in entries if "exception" in e and "req-fail" in e["message"]]
    assert failures, "the failed batch's error, with its exception"
    assert failures[0]["level"] == "error"
    assert "Traceback" in failures[0]["exception"], failures[0]
    # uvicorn's own lines come through the same formatter.
    assert any(e["logger"].startswith("uvicorn") for e in entries), "uvicorn's lines"


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_every_process_of_workers_writes_json_with_its_role(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    args = [*_model_args(tiny_config, tiny_checkpoint), "--workers", "2"]
    log = tmp_path / "server.log"
    with cli_server(args, log) as (_, url), httpx.Client(base_url=url, timeout=60) as client:
        for i in range(6):  # fresh connections: the kernel spreads them over the front ends
            r = httpx.post(url + "/embed", content=marked_png(10 + i), headers=PNG, timeout=60)
            assert r.status_code == 200, r.text
        r = client.post("/embed", content=marked_png(7), headers={**PNG, "X-Request-Id": "bad"})
        assert r.status_code == 500, r.text
    entries = _lines(log)

    roles = {e["role"] for e in entries}
    assert {"main", "engine", "frontend 0", "frontend 1"} <= roles, roles
    access = {k: v for k, v in _access(entries).items() if v["path"] == "/embed"}
    assert len(access) == 7, access  # not counting the start's /readyz polls
    assert all(line["role"].startswith("frontend") for line in access.values())
    assert access["bad"]["status"] == 500
    # The engine's executor failure, with its traceback, as JSON from the engine.
    failures = [e for e in entries if e["role"] == "engine" and "exception" in e]
    assert failures and "Traceback" in failures[0]["exception"], failures
