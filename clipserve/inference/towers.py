"""The image and text towers: one Batcher each over a runtime's executors, and their status.

Built by the app's lifespan with `--workers 1` and by the engine process otherwise: the same
batching either way. `status()` is what `/readyz`, `/healthz` and the scrape-time gauges read;
the engine pushes it to its front ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clipserve.batching import Batcher
from clipserve.inference.runtime import Runtime
from clipserve.metrics import Metrics


@dataclass(frozen=True)
class WorkerStatus:
    """What a front end knows of one device worker (DeviceWorker has the same fields)."""

    device: str
    kind: str
    alive: bool
    error: str | None = None


@dataclass
class Towers:
    image: Batcher
    text: Batcher
    runtime: Runtime

    @classmethod
    def build(cls, runtime: Runtime, metrics: Metrics) -> Towers:
        """Create inside the event loop that will run them. The text tower has its own queue
        and workers (and on CUDA its own device threads)."""
        batching = runtime.config.batching
        image = Batcher(runtime.executors, batching, metrics, runtime.threads,
                        decoders=runtime.device_decoders or None)  # fmt: skip
        text = Batcher(runtime.text_executors, batching, metrics, runtime.text_threads, "text")
        return cls(image, text, runtime)

    def start(self) -> None:
        self.image.start()
        self.text.start()

    async def stop(self) -> None:
        await asyncio.gather(self.image.stop(), self.text.stop())

    def status(self) -> dict[str, Any]:
        """Plain data (it crosses the control channel): workers, queues, wait, memory."""
        return {
            "towers": {
                kind: [[w.device, w.alive, w.error] for w in batcher.workers]
                for kind, batcher in (("image", self.image), ("text", self.text))
            },
            "depth": {"image": self.image.depth(), "text": self.text.depth()},
            "wait_s": self.image.estimated_wait_s(1),
            "memory": {
                ex.info.device: used
                for ex in self.runtime.executors
                if (used := ex.memory()) is not None
            },
        }


def worker_statuses(status: dict[str, Any], kind: str) -> list[WorkerStatus]:
    return [WorkerStatus(d, kind, bool(a), e) for d, a, e in status["towers"].get(kind, [])]


def add_status_gauges(metrics: Metrics, status: Callable[[], dict[str, Any]]) -> None:
    """The scrape-time gauges (queue depth, wait, memory, worker liveness) from `status()`."""
    metrics.add_scrape_time_gauges(
        lambda: status()["depth"],
        lambda: status()["memory"],
        lambda: {
            (d if kind == "image" else f"{kind}:{d}"): bool(alive)
            for kind, workers in status()["towers"].items()
            for d, alive, _ in workers
        },
        lambda: status()["wait_s"],
    )
