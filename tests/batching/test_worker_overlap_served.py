"""The pipelined worker end to end: real uvicorn, real HTTP, the fake as a simulated GPU stream."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from tests.helpers import PNG, RunningServer, Serve, png_bytes, random_pixels, until_async

LATENCY_S = 0.3


def _queued(metrics: str) -> float:
    match = re.search(r"^clipserve_queue_depth (\S+)$", metrics, re.M)
    assert match
    return float(match.group(1))


async def _three_at_once(server: RunningServer) -> tuple[float, float]:
    """(seconds for three one-image requests sent at once, images still queued while the
    first computes)."""
    bodies = [png_bytes(random_pixels(seed)) for seed in range(3)]
    batcher = server.state.towers["image"]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        await client.post("/embed", content=bodies[0], headers=PNG)  # warm: cost measured
        t0 = time.perf_counter()
        posts = [asyncio.create_task(client.post("/embed", content=b, headers=PNG)) for b in bodies]
        # All three decoded and either queued or taken by the worker (the first computing).
        await until_async(lambda: len(batcher.queue) + batcher.workers[0].in_flight == 3)
        queued = _queued((await client.get("/metrics")).text)
        answers = await asyncio.gather(*posts)
        assert [r.status_code for r in answers] == [200] * 3
        return time.perf_counter() - t0, queued


def test_batches_overlap_on_the_device_at_depth_2_and_not_at_depth_1(serve: Serve) -> None:
    """One image per batch, 300 ms of device time each: at depth 2 the worker takes the next
    batch while one computes (the host's share hides behind the device's), at depth 1 only
    once it is done. /info and /metrics show the depth and the device's busy time."""
    option = [f"latency_ms={LATENCY_S * 1000:g}", "stream=1"]
    deep = serve(backend="fake", backend_option=option, max_batch_size=1, pipeline_depth=2)
    flat = serve(backend="fake", backend_option=option, max_batch_size=1, pipeline_depth=1)
    assert httpx.get(deep.url + "/info").json()["batching"]["pipeline_depth"] == 2
    pipelined, waiting_deep = asyncio.run(_three_at_once(deep))
    sequential, waiting_flat = asyncio.run(_three_at_once(flat))
    # While the first batch computes, depth 2 has already taken the second off the queue.
    assert (waiting_deep, waiting_flat) == (1, 2)
    assert pipelined < 3 * LATENCY_S + 0.25, pipelined
    assert sequential >= 3 * LATENCY_S, sequential
    assert deep.state.runtime.executors[0].batches[-3:] == [1, 1, 1]
    metrics = httpx.get(deep.url + "/metrics").text
    busy = re.search(r'clipserve_device_busy_seconds_total\{device="cpu"\} (\S+)', metrics)
    assert busy and float(busy.group(1)) >= 4 * LATENCY_S * 0.9  # four batches' device time
