"""End to end: real uvicorn on 127.0.0.1, real HTTP clients, the tiny open_clip model."""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import httpx
import numpy as np
import pytest

from clipserve.loadgen.images import encode, synthetic_image
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    marked_png,
    metric,
    png_bytes,
    post,
    random_pixels,
    reference_embedding,
    tower_idle,
    until,
    until_async,
)


async def post_many(server: RunningServer, bodies: list[bytes]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        return await asyncio.gather(
            *(client.post("/embed", content=b, headers=PNG) for b in bodies)
        )


def test_embedding_equals_a_direct_model_call(serve: Serve, tiny_model: Any) -> None:
    server = serve()
    pixels = random_pixels(7)
    r = post(server, png_bytes(pixels))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dim"] == 32 and body["normalized"] is True
    assert re.fullmatch(r"tiny-clip/sha256:[0-9a-f]{12}", body["model"])
    np.testing.assert_allclose(
        body["embedding"], reference_embedding(tiny_model, pixels), atol=1e-5
    )

    raw = post(server, png_bytes(pixels), path="/embed?normalize=false").json()
    assert raw["normalized"] is False
    expected = reference_embedding(tiny_model, pixels, normalize=False)
    np.testing.assert_allclose(raw["embedding"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_each_image_format_is_served(serve: Serve, fmt: str) -> None:
    server = serve()
    data = encode(synthetic_image(640, 480, seed=2), fmt)
    r = post(server, data, {"Content-Type": f"image/{fmt.lower()}"})
    assert r.status_code == 200, r.text
    assert np.isclose(np.linalg.norm(r.json()["embedding"]), 1.0, atol=1e-5)


def test_every_response_carries_server_timing_for_each_stage(serve: Serve) -> None:
    r = post(serve(), marked_png(1))
    stages = dict(re.findall(r"(\w+);dur=([0-9.]+)", r.headers["server-timing"]))
    assert set(stages) == {"receive", "decode", "queue", "compute", "encode", "total"}
    assert float(stages["compute"]) > 0
    assert r.headers["x-request-id"]


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=100"], max_batch_size=8)
    bodies = [marked_png(m, seed=m) for m in range(12)]
    responses = asyncio.run(post_many(server, bodies))
    assert all(r.status_code == 200 for r in responses)
    fake = server.state.runtime.executors[0]
    assert max(fake.batches) > 1
    assert metric(server, "clipserve_batch_size_count") < 12  # fewer batches than requests
    assert metric(server, "clipserve_items_total") == 12
    for m, r in zip(range(12), responses, strict=True):  # answers are not mixed up
        pixels = random_pixels(m)
        pixels[0, 0, 0] = m
        want = fake.features(pixels[None]) @ fake._proj
        np.testing.assert_allclose(r.json()["embedding"], want[0] / np.linalg.norm(want), atol=1e-5)


def test_real_model_batches_concurrent_requests(serve: Serve, tiny_model: Any) -> None:
    server = serve(max_batch_size=8)
    pixels = [random_pixels(100 + i) for i in range(16)]
    responses = asyncio.run(post_many(server, [png_bytes(p) for p in pixels]))
    for p, r in zip(pixels, responses, strict=True):
        assert r.status_code == 200
        np.testing.assert_allclose(
            r.json()["embedding"], reference_embedding(tiny_model, p), atol=1e-5
        )
    assert metric(server, "clipserve_items_total") == 16


@pytest.mark.parametrize(
    ("overrides", "body", "headers", "path", "status", "code"),
    [
        ({}, b"not an image", PNG, "/embed", 400, "invalid_image"),
        ({}, b"", PNG, "/embed", 400, "invalid_image"),
        (
            {},
            encode(synthetic_image(640, 480), "JPEG")[:2000],
            {"Content-Type": "image/jpeg"},
            "/embed",
            400,
            "invalid_image",
        ),
        ({"max_body_bytes": 4096}, b"x" * 5000, PNG, "/embed", 413, "payload_too_large"),
        ({"max_image_pixels": 10000}, None, PNG, "/embed", 413, "image_too_large"),
        ({}, b"abc", {"Content-Type": "text/plain"}, "/embed", 415, "unsupported_media_type"),
        ({}, b"abc", {}, "/embed", 415, "unsupported_media_type"),
        ({}, None, {**PNG, "Content-Encoding": "gzip"}, "/embed", 415, "unsupported_media_type"),
        ({}, None, PNG, "/embed?normalize=perhaps", 422, "invalid_parameter"),
        ({}, None, {**PNG, "Accept": "text/html"}, "/embed", 406, "not_acceptable"),
    ],
    ids=[
        "garbage",
        "empty",
        "truncated",
        "body",
        "pixels",
        "media",
        "no-media",
        "compressed",
        "param",
        "accept",
    ],
)
def test_error_table(
    serve: Serve,
    overrides: dict[str, Any],
    body: bytes | None,
    headers: dict[str, str],
    path: str,
    status: int,
    code: str,
) -> None:
    server = serve(**overrides)
    r = post(server, marked_png(1) if body is None else body, headers, path)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    if code == "invalid_image":  # failed after receiving and decoding: those stages are timed
        assert {"receive", "decode"} <= set(re.findall(r"(\w+);dur=", r.headers["server-timing"]))
    # a bad request never takes the server down with it
    small = png_bytes(np.full((64, 64, 3), 90, dtype=np.uint8))  # fits every limit above
    assert post(server, small).status_code == 200


def test_overload_gets_503_with_retry_after(serve: Serve) -> None:
    server = serve(
        backend="fake",
        backend_option=["latency_ms=400"],
        max_batch_size=1,
        max_queue_size=1,
        max_items_per_request=1,
    )
    batcher = server.state.towers["image"]

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = asyncio.create_task(client.post("/embed", content=marked_png(1), headers=PNG))
            await until_async(lambda: any(w.running for w in batcher.workers))  # slot free again
            second = asyncio.create_task(client.post("/embed", content=marked_png(2), headers=PNG))
            await until_async(lambda: batcher.admission.used == 1)  # queued: holds the only slot
            third = await client.post("/embed", content=marked_png(3), headers=PNG)
            return [await first, await second, third]

    first, second, third = asyncio.run(scenario())
    assert (first.status_code, second.status_code) == (200, 200)
    assert third.status_code == 503
    assert third.json()["error"]["code"] == "overloaded"
    assert int(third.headers["retry-after"]) >= 1


def test_timeout_gets_504_and_unstarted_items_never_run(serve: Serve) -> None:
    server = serve(
        backend="fake", backend_option=["latency_ms=600"], max_batch_size=1, request_timeout_s=0.3
    )
    responses = asyncio.run(post_many(server, [marked_png(1), marked_png(2), marked_png(3)]))
    answers = [(r.status_code, r.json()["error"]["code"]) for r in responses]
    # Sent at once, they reach the server in any order: the first to arrive starts and runs
    # past its deadline (504). The cost model, seeded at start-up, knows a batch takes 600 ms:
    # those behind it are refused on arrival, or, where one got in, time out unstarted.
    assert (504, "timeout") in answers, answers
    assert set(answers) <= {(503, "overloaded"), (504, "timeout")}, answers
    fake = server.state.runtime.executors[0]
    # The first batch done and nothing queued or taken after it: whatever was to run has run.
    until(lambda: fake.batches and tower_idle(server.state.towers["image"]))
    assert fake.batches == [1]  # only the first had started; the others were dropped
    assert server.state.towers["image"].depth() == 0


def test_client_that_disconnects_frees_its_slot(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=500"], max_batch_size=1)
    port = server.port
    body = marked_png(1)
    tower = server.state.towers["image"]
    fake = server.state.runtime.executors[0]

    def send_and_leave(sock: socket.socket) -> None:
        head = (
            f"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)

    with socket.create_connection(("127.0.0.1", port)) as busy:
        send_and_leave(busy)
        until(lambda: fake.attempts)  # the first is computing
        leaver = socket.create_connection(("127.0.0.1", port))
        send_and_leave(leaver)
        until(lambda: tower.depth() == 1)
        assert tower.depth() == 1
        leaver.close()
        until(lambda: tower.depth() == 0)
        assert tower.depth() == 0
        assert tower.admission.used == 0
        assert busy.recv(100).startswith(b"HTTP/1.1 200")
    until(lambda: tower_idle(tower))  # had the leaver's image stayed queued, it would run now
    assert fake.batches == [1]


def test_failing_executor_fails_only_its_batch(serve: Serve) -> None:
    server = serve(
        backend="fake",
        gpus="0",
        backend_option=["latency_ms=100", "fail_pixel=7"],
        max_batch_size=1,
    )
    responses = asyncio.run(post_many(server, [marked_png(1), marked_png(7), marked_png(3)]))
    assert [r.status_code for r in responses] == [200, 500, 200]
    assert responses[1].json() == {"error": {"code": "internal", "message": "internal error"}}
    assert post(server, marked_png(4)).status_code == 200  # the worker keeps serving
    assert httpx.get(server.url + "/readyz").status_code == 200
    assert metric(server, 'clipserve_batch_failures_total{device="sim:0"}') == 1


def test_dead_worker_turns_readyz_false(serve: Serve) -> None:
    server = serve(backend="fake", gpus="0", backend_option=["fatal_pixel=9"])
    assert httpx.get(server.url + "/readyz").status_code == 200
    lost = post(server, marked_png(9))  # its device was lost under it: retry elsewhere
    assert lost.status_code == 503 and lost.json()["error"]["code"] == "not_ready"
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 503
    assert ready.json()["workers"]["sim:0"].startswith("dead")
    health = httpx.get(server.url + "/healthz")  # no image worker left: liveness fails too
    assert health.status_code == 503
    assert health.json() == {"status": "failing", "reason": "image tower: no live worker"}
    r = post(server, marked_png(1))
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert r.headers["Retry-After"] == "5"
    assert metric(server, 'clipserve_worker_alive{device="sim:0"}') == 0


def test_one_worker_per_simulated_device(serve: Serve) -> None:
    server = serve(backend="fake", gpus="0,1", backend_option=["latency_ms=60"], max_batch_size=2)
    assert httpx.get(server.url + "/info").json()["devices"] == ["sim:0", "sim:1"]
    responses = asyncio.run(post_many(server, [marked_png(m) for m in range(10)]))
    assert all(r.status_code == 200 for r in responses)
    assert all(ex.batches for ex in server.state.runtime.executors)


def test_info_health_and_metrics(serve: Serve) -> None:
    server = serve(max_batch_size=4)
    info = httpx.get(server.url + "/info").json()
    assert info["embed_dim"] == 32 and info["input_size"] == [224, 224]
    assert info["backend"] == "torch" and info["precision"] == "fp32"
    assert info["devices"] == ["cpu"] and info["batching"]["max_batch_size"] == 4
    assert info["mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    assert info["text"] == {"context_length": 77, "max_text_chars": 1000, "truncate": False}
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").json()["ready"] is True
    post(server, marked_png(1))
    text = httpx.get(server.url + "/metrics").text
    for name in [
        'clipserve_requests_total{route="/embed",status="200"}',
        'clipserve_request_duration_seconds_count{route="/embed"}',
        'clipserve_stage_duration_seconds_count{protocol="png",stage="decode"}',
        "clipserve_batch_size_count",
        "clipserve_queue_depth 0.0",
        "clipserve_text_queue_depth 0.0",
        'clipserve_worker_alive{device="cpu"} 1.0',
        'clipserve_worker_alive{device="text:cpu"} 1.0',
        "clipserve_estimated_wait_seconds",
        "clipserve_items_total",
    ]:
        assert name in text, name


def test_every_content_encoding_header_is_checked(module_server: RunningServer) -> None:
    """`identity` first does not let a second, compressed one through (the map keeps the first)."""
    headers = [
        ("content-type", "image/png"),
        ("content-encoding", "identity"),
        ("content-encoding", "gzip"),
    ]
    r = httpx.post(module_server.url + "/embed", content=marked_png(1), headers=headers)
    assert r.status_code == 415 and "Content-Encoding gzip" in r.json()["error"]["message"]
    plain = httpx.post(module_server.url + "/embed", content=marked_png(1), headers=headers[:2])
    assert plain.status_code == 200, plain.text
