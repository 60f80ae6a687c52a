"""The image and text towers: one Batcher each over a runtime's executors, and their status.

Built by the app's lifespan with `--workers 1` and by the engine process otherwise: the same
batching either way. `status()` is what `/readyz`, `/healthz` and the scrape-time gauges read;
the engine pushes it to its front ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from clipserve.batching import Batcher, TowerKind
from clipserve.batching.cache import embedding_cache
from clipserve.engine.messages import Status, WorkerRow
from clipserve.inference.runtime import Runtime
from clipserve.metrics import Metrics


@dataclass(frozen=True)
class WorkerStatus:
    """What a front end knows of one device worker (DeviceWorker has the same fields)."""

    device: str
    kind: TowerKind
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
        decoders = runtime.device_decoders or None
        cache = embedding_cache(runtime.config.cache, metrics)  # both towers' one budget
        image = Batcher(
            runtime.executors,
            batching,
            metrics,
            runtime.threads,
            decoders=decoders,
            cache=cache,
            warm_costs=runtime.warm_costs or None,
        )
        text = Batcher(
            runtime.text_executors,
            batching,
            metrics,
            runtime.text_threads,
            "text",
            cache=cache,
            warm_costs=runtime.text_warm_costs or None,
        )
        return cls(image, text, runtime)

    def start(self) -> None:
        self.image.start()
        self.text.start()

    async def stop(self) -> None:
        await asyncio.gather(self.image.stop(), self.text.stop())

    def status(self) -> Status:
        """Plain data (it crosses the control channel): workers, queues, wait, memory."""
        return {
            "towers": {"image": _rows(self.image), "text": _rows(self.text)},
            "depth": {"image": self.image.depth(), "text": self.text.depth()},
            "admitted": {"image": self.image.admitted(), "text": self.text.admitted()},
            "wait_s": self.image.estimated_wait_s(1),
            "memory": {
                ex.info.device: used
                for ex in self.runtime.executors
                if (used := ex.memory()) is not None
            },
        }


def _rows(batcher: Batcher) -> list[WorkerRow]:
    return [{"device": w.device, "alive": w.alive, "error": w.error} for w in batcher.workers]


def worker_statuses(status: Status, kind: TowerKind) -> list[WorkerStatus]:
    rows = status["towers"].get(kind, [])
    return [WorkerStatus(w["device"], kind, w["alive"], w["error"]) for w in rows]


def _alive(status: Status) -> dict[str, bool]:
    """Each worker's liveness by gauge label: the device for the image tower, `text:<device>`
    for the text tower's."""
    return {
        (w["device"] if kind == "image" else f"{kind}:{w['device']}"): w["alive"]
        for kind, rows in status["towers"].items()
        for w in rows
    }


def add_status_gauges(metrics: Metrics, status: Callable[[], Status]) -> None:
    """The scrape-time gauges (queue depth, wait, memory, worker liveness) from `status()`."""
    metrics.add_scrape_time_gauges(
        # Metrics takes Mapping[str, int], invariant in its key type: a copy with str keys.
        lambda: {kind: n for kind, n in status()["depth"].items()},
        lambda: {kind: n for kind, n in status()["admitted"].items()},
        lambda: status()["memory"],
        lambda: _alive(status()),
        lambda: status()["wait_s"],
    )
