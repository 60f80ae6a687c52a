"""End to end under overload and bad batches: deadline-aware admission, poison isolation and
non-finite outputs, with real uvicorn, real HTTP clients and the fake executor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    marked_png,
    metric,
    model_name,
    random_pixels,
    until_async,
)

MSGPACK = {"Content-Type": "application/msgpack"}
JSON = {"Content-Type": "application/json"}


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
    server = serve(
        backend="fake",
        gpus="0",
        backend_option=["latency_ms=30", "fail_pixel=7"],
        max_batch_size=8,
        max_queue_delay_ms=20,
    )
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
    server = serve(
        backend="fake",
        backend_option=["nan_pixel=5", "latency_ms=400"],
        max_batch_size=2,
        max_queue_delay_ms=1000,
    )
    fake = server.state.runtime.executors[0]

    async def behind_a_running_batch() -> list[tuple[httpx.Response, float]]:
        # A lone request is taken at once (nothing waits for requests that may never come):
        # the two queue together behind a batch on the device, however the machine is loaded.
        blocker = asyncio.create_task(timed_posts(server, [marked_png(9)]))
        await until_async(lambda: fake.attempts, 30, "the first batch on the device")
        pair = await timed_posts(server, [marked_png(5), marked_png(6)])
        assert (await blocker)[0][0].status_code == 200
        return pair

    (bad, _), (good, _) = asyncio.run(behind_a_running_batch())
    assert fake.batches == [1, 2]  # the pair computed together
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


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_bodies_are_parsed_only_once_admitted(serve: Serve) -> None:
    """Admission comes before parsing on every door, so parsing in the pool is bounded by the
    queues too: with the image queue full a malformed msgpack body on /embed and a malformed
    KServe body, and with the text queue full a malformed OpenAI body, are refused 503 in that
    door's own error shape, never parsed (a parse would answer 400)."""
    server = serve(
        backend="fake",
        backend_option=["latency_ms=2000"],
        max_batch_size=4,
        max_queue_size=4,
        max_items_per_request=4,
    )
    image, text = server.state.runtime.executors[0], server.state.runtime.text_executors[0]
    name = model_name(server)

    async def refused_when_full(
        client: httpx.AsyncClient,
        executor: Any,
        one: Callable[[], Awaitable[httpx.Response]],
        four: Callable[[], Awaitable[httpx.Response]],
        gauge: str,
        *bad: Callable[[], Awaitable[httpx.Response]],
    ) -> tuple[list[int], list[httpx.Response]]:
        first = asyncio.create_task(one())
        # Computing (2 s) and out of the queue: the next four items then fill it exactly.
        await until_async(lambda: bool(executor.attempts))
        fill = asyncio.create_task(four())
        await until_async(lambda: metric(server, gauge) == 4)
        tower = "text" if "text" in gauge else "image"  # the queued items hold their places
        assert metric(server, f'clipserve_admitted_items{{tower="{tower}"}}') == 4
        refused = [await b() for b in bad]
        return [r.status_code for r in await asyncio.gather(first, fill)], refused

    async def main() -> tuple[list[int], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            # On a CPU host the towers share a thread, so one tower is filled at a time.
            images, refused = await refused_when_full(
                client,
                image,
                lambda: client.post("/embed", content=marked_png(1), headers=PNG),
                lambda: client.post(
                    "/embed",
                    files=[
                        ("image", (f"{m}.png", marked_png(m), "image/png")) for m in range(2, 6)
                    ],
                ),
                "clipserve_queue_depth",
                lambda: client.post("/embed", content=b"\xc1 not msgpack", headers=MSGPACK),
                lambda: client.post(f"/v2/models/{name}/infer", content=b"{not", headers=JSON),
            )
            texts, refused_text = await refused_when_full(
                client,
                text,
                lambda: client.post("/v1/embeddings", json={"input": "a cat"}),
                lambda: client.post("/v1/embeddings", json={"input": ["a", "b", "c", "d"]}),
                "clipserve_text_queue_depth",
                lambda: client.post("/v1/embeddings", content=b"{not", headers=JSON),
            )
            return images + texts, refused + refused_text

    statuses, (native, kserve, openai) = asyncio.run(main())
    assert statuses == [200] * 4
    assert all("Retry-After" in r.headers for r in (native, kserve, openai))
    assert native.status_code == 503, native.text
    assert native.json()["error"]["code"] == "overloaded"
    assert kserve.status_code == 503, kserve.text
    assert "error" in kserve.json()
    assert openai.status_code == 503, openai.text
    assert openai.json()["error"]["type"] in {"server_error", "overloaded"}, openai.json()
