"""Per-request stage timing, rendered as a Server-Timing header and fed to Prometheus."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageTimer:
    def __init__(self) -> None:
        self.stages: dict[str, float] = {}  # stage → seconds

    @contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0)

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + max(seconds, 0.0)

    def header(self) -> str:
        return ", ".join(f"{name};dur={s * 1000:.3f}" for name, s in self.stages.items())
