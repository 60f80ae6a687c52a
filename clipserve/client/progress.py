"""A progress bar on stderr for long runs, drawn only where someone can see it (a terminal);
hand-written, so the client needs no dependency for it."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24  # characters of bar
MIN_INTERVAL_S = 0.1  # redraw at most this often: a terminal write per batch is too many


class Progress:
    """`advance(n)` as items finish, `close()` at the end. `enabled=None`: only when `stream`
    (stderr by default) is a terminal."""

    def __init__(
        self, total: int, label: str, enabled: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = self.stream.isatty()
        self.enabled = enabled and total > 0
        self.total = total
        self.label = label
        self.done = 0
        self._t0 = time.monotonic()
        self._drawn = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= MIN_INTERVAL_S or self.done >= self.total):
            self._drawn = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()

    def line(self, now: float) -> str:
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = round(WIDTH * fraction)
        elapsed = max(now - self._t0, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * filled + "-" * (WIDTH - filled)
        return (
            f"{self.label} [{bar}] {self.done}/{self.total} {fraction:4.0%} "
            f"{rate:,.0f}/s eta {eta:4.0f}s "
        )

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
