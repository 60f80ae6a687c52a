"""Admission is calibrated from the first request: each image worker's cost model starts from
batches timed right after its executor's warm-up (a cold model guessed, and refused requests
the device could have served, after every start and engine restart)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clipserve.inference.runtime import Runtime, build_runtime
from clipserve.inference.towers import Towers
from clipserve.metrics import Metrics
from tests.helpers import PNG, Serve, make_config, marked_png

LATENCY_S, PER_ITEM_S = 0.02, 0.004  # the fake device: 20 ms a batch + 4 ms an image


@pytest.fixture(scope="module")
def runtime(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[Runtime]:
    config = make_config(
        tiny_config,
        tiny_checkpoint,
        backend="fake",
        backend_option=[f"latency_ms={LATENCY_S * 1000:g}", f"per_item_ms={PER_ITEM_S * 1000:g}"],
        max_batch_size=16,
    )
    rt = build_runtime(config)
    yield rt
    rt.close()


def test_each_executor_is_timed_at_its_smallest_and_largest_batch(runtime: Runtime) -> None:
    [costs] = runtime.warm_costs
    assert [n for n, _ in costs] == [1, 16]
    for n, seconds in costs:
        expected = LATENCY_S + PER_ITEM_S * n
        assert expected <= seconds < expected + 0.5, (n, seconds)  # sleeps: never shorter


def test_workers_start_with_a_model_that_predicts_the_measured_batches(runtime: Runtime) -> None:
    async def build() -> Towers:
        return Towers.build(runtime, Metrics())

    towers = asyncio.run(build())
    [worker] = towers.image.workers
    assert worker.cost.ready  # before any request
    for n, seconds in runtime.warm_costs[0]:
        assert worker.cost.seconds(n) == pytest.approx(seconds, rel=0.05)
    # Between the two sizes the line holds: 8 images ~ 20 + 32 ms, not 8 whole batches.
    assert worker.cost.seconds(8) == pytest.approx(LATENCY_S + 8 * PER_ITEM_S, abs=0.1)
    [text_worker] = towers.text.workers  # the text tower too, from its own timed batches
    assert text_worker.cost.ready
    [text_costs] = runtime.text_warm_costs
    assert [n for n, _ in text_costs] == [1, 16]
    for n, seconds in text_costs:
        assert text_worker.cost.seconds(n) == pytest.approx(seconds, rel=0.05)


def test_no_503_after_start_at_a_load_the_server_can_carry(serve: Serve) -> None:
    """A device of 100 ms a batch whatever its size (up to 32): 48 images at once take two or
    three batches. Cold, the model fitted to the first request's batch of one would say 100 ms
    an image (4.8 s for 48, past the 1 s deadline) and refuse most of them."""
    server = serve(
        backend="fake",
        backend_option=["latency_ms=100"],
        max_batch_size=32,
        request_timeout_s=1.0,
        max_queue_delay_ms=5,
    )
    assert httpx.post(server.url + "/embed", content=marked_png(1), headers=PNG).status_code == 200

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            answers = await asyncio.gather(
                *(
                    client.post("/embed", content=marked_png(2, seed=i), headers=PNG)
                    for i in range(48)
                )
            )
        return [r.status_code for r in answers]

    statuses = asyncio.run(burst())
    assert statuses == [200] * 48, {s: statuses.count(s) for s in set(statuses)}
