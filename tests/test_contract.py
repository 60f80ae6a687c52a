"""The documented contract at the edge: JSON for every error, X-Request-Id, Server-Timing on
every answer, the in-flight body budget, per-request deadlines and shutdown answers."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import PNG, Serve, cli_server, png_bytes, random_pixels, until, until_checked


def error_of(r: httpx.Response) -> dict[str, str]:
    assert r.headers["content-type"] == "application/json", r.text
    return r.json()["error"]  # type: ignore[no-any-return]


def test_unknown_route_and_wrong_method_answer_json(serve: Serve) -> None:
    server = serve(backend="fake")
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    r = httpx.get(server.url + "/embed")
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"
    assert "server-timing" in r.headers and "x-request-id" in r.headers
    text = httpx.get(server.url + "/metrics").text
    assert 'clipserve_requests_total{route="other",status="404"} 1.0' in text


@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    [
        ("GET", "/healthz", None, {}),
        ("GET", "/readyz", None, {}),
        ("GET", "/info", None, {}),
        ("GET", "/metrics", None, {}),
        ("POST", "/embed", b"x", {"Content-Type": "text/plain"}),  # 415
        ("POST", "/embed", b"x", {**PNG, "Accept": "text/html"}),  # 406
        ("POST", "/embed?normalize=perhaps", b"x", PNG),  # 422
        ("POST", "/embed", b"not an image", PNG),  # 400 after the receive stage
    ],
)
def test_every_response_carries_server_timing_with_a_total(
    serve: Serve, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> None:
    server = serve(backend="fake")
    r = httpx.request(method, server.url + path, content=body, headers=headers)
    timing = r.headers["server-timing"]
    assert timing.split(", ")[-1].startswith("total;dur="), timing
    if r.status_code == 400:
        assert timing.startswith("receive;dur="), timing


def test_timeout_shows_the_queue_wait_in_server_timing(serve: Serve) -> None:
    server = serve(
        backend="fake", backend_option=["latency_ms=600"], max_batch_size=1, request_timeout_s=0.3
    )

    async def two() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            body = png_bytes(random_pixels(1))
            return await asyncio.gather(
                *(client.post("/embed", content=body, headers=PNG) for _ in range(2))
            )

    late = [r for r in asyncio.run(two()) if r.status_code == 504]
    assert late, "one request should wait behind the other past its deadline"
    stages = dict(part.split(";dur=") for part in late[0].headers["server-timing"].split(", "))
    assert {"receive", "decode", "queue", "total"} <= stages.keys()


@pytest.mark.parametrize("raw", [b"caf\xe9", b"a b", b"x" * 129, b"tab\tinside"])
def test_request_id_must_be_visible_ascii(serve: Serve, raw: bytes) -> None:
    server = serve(backend="fake")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + raw + b"\r\n\r\n")
        sock.settimeout(5)
        head, _, body = sock.recv(65536).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert json.loads(body)["error"]["code"] == "invalid_header"
    assert raw not in head  # a fresh id is echoed, never the bytes it refused


def test_visible_ascii_request_id_is_echoed_exactly(serve: Serve) -> None:
    server = serve(backend="fake")
    rid = "Req-42/abc:~!" + "z" * 100
    assert (
        httpx.get(server.url + "/healthz", headers={"X-Request-Id": rid}).headers["x-request-id"]
        == rid
    )


def test_request_timeout_header_shortens_the_deadline(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=500"])
    body = png_bytes(random_pixels(2))
    t0 = time.monotonic()
    r = httpx.post(
        server.url + "/embed", content=body, headers={**PNG, "X-Request-Timeout-Ms": "150"}
    )
    assert r.status_code == 504 and time.monotonic() - t0 < 0.45
    assert "X-Request-Timeout-Ms" in error_of(r)["message"]
    # Capped by the server's own timeout; garbage is refused.
    r = httpx.post(
        server.url + "/embed", content=body, headers={**PNG, "X-Request-Timeout-Ms": "1e9"}
    )
    assert r.status_code == 200
    for bad in ("soon", "-5", "0", "nan", "inf"):
        r = httpx.post(
            server.url + "/embed", content=body, headers={**PNG, "X-Request-Timeout-Ms": bad}
        )
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_header", bad


def test_bodies_in_flight_are_bounded(serve: Serve) -> None:
    """Bytes held by incomplete bodies count against one budget: past it, 503 at once."""
    server = serve(backend="fake", max_body_bytes=1 << 20, max_body_bytes_in_flight=3 << 20)
    port = server.port
    budget = server.state.body_budget
    held = []
    sent = (1 << 20) - 1000
    try:
        for _ in range(3):  # 3 bodies of 1 MiB, all but their last 1000 bytes sent
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(
                b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                b"Content-Length: 1048576\r\n\r\n" + b"\0" * sent
            )
            held.append(s)
        until(lambda: budget.used == 3 * sent)
        r = httpx.post(server.url + "/embed", content=png_bytes(random_pixels(3)), headers=PNG)
        assert r.status_code == 503 and error_of(r)["code"] == "overloaded"
        assert "--max-body-bytes-in-flight" in error_of(r)["message"]
        assert int(r.headers["retry-after"]) >= 1
        # Headers alone reserve nothing: a declared body that never comes holds no budget.
        idle = socket.create_connection(("127.0.0.1", port))
        idle.sendall(
            b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Content-Length: 1048576\r\n\r\n"
        )
        held.append(idle)
    finally:
        for s in held[:3]:
            s.close()
    until(lambda: budget.used == 0)  # released when their clients go away
    r = httpx.post(server.url + "/embed", content=png_bytes(random_pixels(3)), headers=PNG)
    assert r.status_code == 200
    held[3].close()


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_drain_timeout_answers_503_json_with_one_log_line_each(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    args = [
        "--model",
        str(tiny_config),
        "--checkpoint",
        str(tiny_checkpoint),
        "--backend",
        "fake",
        "--backend-option",
        "latency_ms=3000",
        "--max-batch-size",
        "1",
        "--drain-timeout-s",
        "1",
    ]
    log_path = tmp_path / "server.log"
    with cli_server(args, log_path) as (proc, url):

        async def load() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                # Three different images: identical ones would be computed once (the cache).
                bodies = [png_bytes(random_pixels(i)) for i in range(3)]
                tasks = [
                    asyncio.create_task(client.post("/embed", content=body, headers=PNG))
                    for body in bodies
                ]

                async def one_computing_two_queued() -> bool:
                    metrics = (await client.get("/metrics")).text
                    return "clipserve_queue_depth 2.0" in metrics

                await until_checked(one_computing_two_queued)  # then stop the server
                proc.send_signal(signal.SIGTERM)
                return [await t for t in tasks]

        responses = asyncio.run(load())
        proc.wait(timeout=20)
    cut = [r for r in responses if r.status_code != 200]
    assert cut, [r.status_code for r in responses]
    for r in cut:
        assert r.status_code == 503 and error_of(r)["code"] == "shutting_down"
        assert r.headers["retry-after"] == "1"
    text = log_path.read_text()
    assert "Traceback" not in text
    assert text.count("cancelled: drain timeout expired") == len(cut)


def _word(n: int) -> str:
    """A distinct all-letter word per n (digits would be split off as their own tokens)."""
    return "z" + "".join(chr(97 + (n // 26**k) % 26) for k in range(3))


def test_tokenizer_cache_stays_bounded(serve: Serve) -> None:
    from clipserve.inference import model

    server = serve(backend="fake")
    tokenizer = server.state.runtime.model.tokenizer
    specials = {k for k, v in tokenizer.cache.items() if k == v}
    limit, model.TOKENIZER_CACHE_ENTRIES = model.TOKENIZER_CACHE_ENTRIES, 50
    try:
        for batch in range(4):  # 4 x 30 distinct words, far past the lowered limit
            texts = [_word(batch * 30 + i) for i in range(30)]
            r = httpx.post(server.url + "/embed/text", json={"texts": texts})
            assert r.status_code == 200
        assert len(tokenizer.cache) <= 50 + 30 + len(specials)
        assert any(k == _word(119) for k in tokenizer.cache)  # the newest words are cached
        assert specials <= tokenizer.cache.keys()  # the special tokens survive a reset
    finally:
        model.TOKENIZER_CACHE_ENTRIES = limit


def test_unexpected_errors_answer_opaque_json_500_with_the_usual_headers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not a domain error (a bug): the outermost layer answers it like every other error."""
    from prometheus_client import CollectorRegistry

    from clipserve.http.doors import DOORS
    from clipserve.http.observer import RequestObserver
    from clipserve.http.status import ErrorPages
    from clipserve.metrics import Metrics

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/x", "headers": [(b"x-request-id", b"r1")]}
    observer = RequestObserver(broken, Metrics(CollectorRegistry()), ErrorPages(DOORS))
    asyncio.run(observer(scope, receive, send))
    start, body = sent[0], sent[1]
    assert start["status"] == 500
    headers = dict(start["headers"])
    assert headers[b"x-request-id"] == b"r1" and headers[b"server-timing"].startswith(b"total;")
    assert json.loads(body["body"]) == {"error": {"code": "internal", "message": "internal error"}}
    assert [r.getMessage() for r in caplog.records] == ["unhandled error, request id r1"]
