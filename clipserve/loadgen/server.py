"""The server's side of a load point: `/info`, and `/metrics` scraped as the window opens and
after it closes.

The difference of two scrapes says what the server did during the window: requests by status,
images embedded, batches and their sizes, and the time per stage (receive, decode, fetch,
cache, queue, compute, encode) from `clipserve_stage_duration_seconds`, which counts inference
requests answered 200 only: its means are per such request (0 for a stage a request skipped,
as a cache hit skips queue and compute), and per request that reached the stage.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples | None:
    """The server's metrics, or None where it has none (another server, or it is down)."""
    try:
        async with session.get(url.rstrip("/") + "/metrics") as r:
            if r.status != 200:
                return None
            return parse_metrics(await r.text())
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None


async def fetch_info(url: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url.rstrip("/") + "/info") as r,
        ):
            if r.status != 200:
                return None
            info = await r.json()
            return info if isinstance(info, dict) else None
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None


@dataclass
class Breakdown:
    """What the server did between two scrapes."""

    requests_by_status: dict[str, float] = field(default_factory=dict)
    images: float = 0.0
    batches: float = 0.0
    mean_batch_size: float | None = None
    batched_share: float | None = None  # images that shared their forward pass with another
    # Mean ms per stage: per successful inference request, and per one that reached the stage.
    stage_ms: dict[str, float] = field(default_factory=dict)
    stage_ms_reached: dict[str, float] = field(default_factory=dict)
    stage_requests: dict[str, float] = field(default_factory=dict)  # requests that reached it
    batch_ms_by_device: dict[str, float] = field(default_factory=dict)  # mean forward pass
    batches_by_device: dict[str, float] = field(default_factory=dict)
    queue_depth_after: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _delta(before: Samples, after: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def breakdown(before: Samples | None, after: Samples | None) -> Breakdown | None:
    if before is None or after is None:
        return None
    d = _delta(before, after)
    out = Breakdown()
    stage_sum: dict[str, float] = defaultdict(float)
    stage_count: dict[str, float] = defaultdict(float)
    batch_sum: dict[str, float] = defaultdict(float)
    ones = 0.0
    succeeded = 0.0  # inference requests answered 200, the stages' requests
    for (name, labels), value in d.items():
        lab = dict(labels)
        if name == "clipserve_requests_total" and value and lab.get("route") != "/metrics":
            key = f"{lab.get('route', '')} {lab.get('status', '')}".strip()
            out.requests_by_status[key] = value
        elif name == "clipserve_batch_size_count":
            out.batches = value
        elif name == "clipserve_batch_size_sum":
            out.images = value
        elif name == "clipserve_batch_size_bucket" and lab.get("le") == "1.0":
            ones = value  # batch sizes are whole numbers: le=1 holds the batches of one
        elif name == "clipserve_stage_duration_seconds_sum":
            stage_sum[lab["stage"]] += value
        elif name == "clipserve_stage_duration_seconds_count":
            stage_count[lab["stage"]] += value
        elif name == "clipserve_model_requests_total" and lab.get("outcome") == "success":
            succeeded += value
        elif name == "clipserve_batch_duration_seconds_sum":
            batch_sum[lab["device"]] += value
        elif name == "clipserve_batch_duration_seconds_count" and value:
            out.batches_by_device[lab["device"]] = value
    if out.batches:
        out.mean_batch_size = round(out.images / out.batches, 3)
        out.batched_share = round((out.images - ones) / out.images, 3) if out.images else None
    reached = {s: n for s, n in stage_count.items() if n > 0}
    out.stage_requests = reached
    out.stage_ms_reached = {s: round(stage_sum[s] / n * 1000, 3) for s, n in reached.items()}
    # Without the Triton statistics (an older server): the most requests any stage saw.
    requests = succeeded or max(reached.values(), default=0.0)
    out.stage_ms = {s: round(stage_sum[s] / requests * 1000, 3) for s in reached}
    out.batch_ms_by_device = {
        dev: round(batch_sum[dev] / n * 1000, 3) for dev, n in out.batches_by_device.items()
    }
    depth = after.get(("clipserve_queue_depth", ()))
    out.queue_depth_after = depth
    return out
