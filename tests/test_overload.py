"""End to end under overload and bad batches: deadline-aware admission, poison isolation and
non-finite outputs, with real uvicorn, real HTTP clients and the fake executor."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import httpx
import numpy as np

from tests.conftest import RunningServer, png_bytes, random_pixels, until

Serve = Callable[..., RunningServer]
PNG = {"Content-Type": "image/png"}
MSGPACK = "application/msgpack"


def marked_png(mark: int, seed: int = 0) -> bytes:
    """A 224x224 PNG (decoded without resampling) whose top-left red value is `mark`."""
    pixels = random_pixels(seed)
    pixels[0, 0, 0] = mark
    return png_bytes(pixels)


def metric(server: RunningServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def timed_posts(
    server: RunningServer, bodies: list[bytes], headers: dict[str, str] | None = None
) -> list[tuple[httpx.Response, float]]:
    """All bodies at once; each answer with its own latency in seconds."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

        async def one(body: bytes) -> tuple[httpx.Response, float]:
            t0 = time.perf_counter()
            r = await client.post("/embed", content=body, headers={**PNG, **(headers or {})})
            return r, time.perf_counter() - t0

        return await asyncio.gather(*(one(b) for b in bodies))


def test_poisoned_requests_fail_alone_in_a_stream(serve: Serve) -> None:
    server = serve(backend="fake", gpus="0", backend_option=["latency_ms=30", "fail_pixel=7"],
                   max_batch_size=8, max_queue_delay_ms=20)  # fmt: skip
    marks = [7 if i % 20 == 0 else 100 + i for i in range(60)]  # 1 request in 20 is poisoned
    answers = asyncio.run(timed_posts(server, [marked_png(m, seed=i) for i, m in enumerate(marks)]))
    statuses = [r.status_code for r, _ in answers]
    assert statuses == [500 if m == 7 else 200 for m in marks]  # 0 clean requests failed
    fake = server.state.runtime.executors[0]
    assert fake.items_run == 57
    # a retry means a poisoned item shared its batch with clean ones, which then got their 200
    assert metric(server, 'clipserve_batch_retries_total{device="sim:0"}') >= 2
    assert metric(server, "clipserve_items_total") == 57
    clean = answers[1][0].json()["embedding"]
    pixels = random_pixels(1)
    pixels[0, 0, 0] = 101
    want = fake.features(pixels[None]) @ fake._proj
    np.testing.assert_allclose(clean, want[0] / np.linalg.norm(want), rtol=1e-4, atol=1e-6)


def test_non_finite_embedding_fails_only_its_request(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["nan_pixel=5"], max_batch_size=2,
                   max_queue_delay_ms=1000)  # fmt: skip
    (bad, _), (good, _) = asyncio.run(timed_posts(server, [marked_png(5), marked_png(6)]))
    assert server.state.runtime.executors[0].batches == [2]  # computed together
    assert bad.status_code == 422
    assert bad.json()["error"]["code"] == "non_finite_embedding"
    assert "non-finite" in bad.json()["error"]["message"]
    assert good.status_code == 200
    assert np.isfinite(good.json()["embedding"]).all()


def test_requests_that_cannot_finish_by_their_deadline_are_refused_at_once(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["per_item_ms=100"], max_batch_size=1)
    fake = server.state.runtime.executors[0]
    assert httpx.post(server.url + "/embed", content=marked_png(1), headers=PNG).status_code == 200
    answers = asyncio.run(
        timed_posts(server, [marked_png(m) for m in range(10, 22)], {"X-Request-Timeout-Ms": "600"})
    )
    ok = [(r, s) for r, s in answers if r.status_code == 200]
    refused = [(r, s) for r, s in answers if r.status_code == 503]
    assert len(ok) + len(refused) == 12, [r.status_code for r, _ in answers]  # no 504s
    assert len(ok) >= 2 and len(refused) >= 5
    for r, seconds in refused:
        assert r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
        assert seconds < 0.6  # refused on arrival, before its deadline could pass in the queue
    assert fake.items_run == 1 + len(ok)  # nothing was computed for a request that failed


def test_bodies_are_parsed_only_once_admitted(serve: Serve) -> None:
    """With the queue full, a malformed msgpack body is refused 503, not 400: admission comes
    before parsing, so parsing in the pool is bounded by the queue too."""
    server = serve(backend="fake", backend_option=["latency_ms=2000"], max_batch_size=4,
                   max_queue_size=4, max_items_per_request=4)  # fmt: skip
    fake = server.state.runtime.executors[0]

    async def main() -> tuple[list[int], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = asyncio.create_task(client.post("/embed", content=marked_png(1), headers=PNG))
            # Computing (2 s) and out of the queue: the next four then fill it exactly.
            await until(lambda: bool(fake.attempts))
            fill = [asyncio.create_task(client.post("/embed", content=marked_png(m), headers=PNG))
                    for m in range(2, 6)]  # fmt: skip
            await until(lambda: metric(server, "clipserve_queue_depth") == 4)
            bad = await client.post(
                "/embed", content=b"\xc1 not msgpack", headers={"Content-Type": MSGPACK}
            )
            done = await asyncio.gather(first, *fill)
            return [r.status_code for r in done], bad

    statuses, bad = asyncio.run(main())
    assert statuses == [200] * 5
    assert bad.status_code == 503, bad.text
    assert bad.json()["error"]["code"] == "overloaded"
