"""The collector while serving: startup frozen and the young threshold raised for the server's
life, both undone after (the tests' servers run in this process)."""

from __future__ import annotations

import gc
from pathlib import Path

from clipserve import collector
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
