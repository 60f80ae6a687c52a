"""The collector while serving: startup frozen and the young threshold raised for the server's
life (an app's and the engine's), both undone after (the tests' servers run in this process)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from clipserve import collector
from clipserve.engine.service import EngineService
from clipserve.inference.runtime import build_runtime
from clipserve.metrics import Metrics
from tests.helpers import make_config, running


def test_serving_raises_the_young_threshold_and_freezes_then_restores() -> None:
    before = gc.get_threshold()
    keep = [[i] for i in range(100)]  # tracked objects for the freeze to move
    with collector.serving():
        assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() >= len(keep)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_overlapping_servers_keep_it_until_the_last_stops() -> None:
    before = gc.get_threshold()
    first, second = collector.serving(), collector.serving()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first to start stops first
    assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD
    assert gc.get_freeze_count() > 0
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_running_server_serves_with_it(tiny_config: Path, tiny_checkpoint: Path) -> None:
    before = gc.get_threshold()
    with running(make_config(tiny_config, tiny_checkpoint)):
        assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before


def test_the_engine_serves_with_it(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    config = make_config(tiny_config, tiny_checkpoint, backend="fake")
    runtime = build_runtime(config)
    before = gc.get_threshold()

    async def main() -> None:
        service = EngineService(runtime, Metrics())
        stop, ready = asyncio.Event(), asyncio.Event()
        serving = asyncio.create_task(service.serve(tmp_path / "engine.sock", ready.set, stop))
        await ready.wait()
        assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0
        stop.set()
        await serving
        assert gc.get_threshold() == before

    try:
        asyncio.run(main())
    finally:
        runtime.close()
