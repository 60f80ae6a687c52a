"""Per-request stage timing, rendered as a Server-Timing header and fed to Prometheus."""

from __future__ import annotations

import time
from types import TracebackType


class StageTimer:
    def __init__(self) -> None:
        self.stages: dict[str, float] = {}  # stage → seconds

    def measure(self, stage: str) -> _Measure:
        """`with timer.measure("decode"):` adds the block's time to the stage, raised or not."""
        return _Measure(self, stage)

    def add(self, stage: str, seconds: float) -> None:
        stages = self.stages
        stages[stage] = stages.get(stage, 0.0) + (seconds if seconds > 0.0 else 0.0)

    def header(self) -> str:
        # A list, not a generator: join takes it in one call, not one resume per stage.
        return ", ".join([f"{name};dur={s * 1000:.3f}" for name, s in self.stages.items()])


class _Measure:
    """`StageTimer.measure`'s block: a plain object, not a generator context manager, which
    cost ~5 µs a block on the event loop and a request has four or five of them."""

    __slots__ = ("stage", "t0", "timer")

    def __init__(self, timer: StageTimer, stage: str) -> None:
        self.timer = timer
        self.stage = stage
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        # `add`'s body, without its call: a monotonic clock's difference is never negative.
        stages, stage = self.timer.stages, self.stage
        stages[stage] = stages.get(stage, 0.0) + (time.perf_counter() - self.t0)
