"""Latency histograms (HdrHistogram: 1 µs to 1 h at 3 significant digits, mergeable across
client processes) and the per-run counters the load generator keeps."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hdrh.histogram import HdrHistogram

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
_HIGHEST_US = 3_600_000_000


def _label(p: float) -> str:
    return f"p{p:g}"


class Latencies:
    """Seconds in, milliseconds out; stored in microseconds."""

    def __init__(self, encoded: str | bytes | None = None) -> None:
        self.hist = HdrHistogram.decode(encoded) if encoded else HdrHistogram(1, _HIGHEST_US, 3)

    def record(self, seconds: float) -> None:
        self.hist.record_value(min(_HIGHEST_US, max(1, round(seconds * 1e6))))

    @property
    def count(self) -> int:
        return int(self.hist.get_total_count())

    def percentile_ms(self, p: float) -> float:
        return float(self.hist.get_value_at_percentile(p)) / 1000 if self.count else 0.0

    def summary(self) -> dict[str, float]:
        """p50/p90/p99/p99.9, max and mean in milliseconds; empty when nothing was recorded."""
        if not self.count:
            return {}
        out = {_label(p): round(self.percentile_ms(p), 3) for p in PERCENTILES}
        out["max"] = round(float(self.hist.get_max_value()) / 1000, 3)
        out["mean"] = round(float(self.hist.get_mean_value()) / 1000, 3)
        return out

    def merge(self, other: Latencies) -> None:
        self.hist.add(other.hist)

    def encode(self) -> str:
        return bytes(self.hist.encode()).decode()


@dataclass
class Tally:
    """What one client process counted for one load point; merged across processes."""

    # OK answers, and requests unfinished when the window closed (at their age then: a stall
    # shows); error answers apart, so fast refusals do not flatter the percentiles.
    latency: Latencies = field(default_factory=Latencies)
    error_latency: Latencies = field(default_factory=Latencies)
    send_lag: Latencies = field(default_factory=Latencies)  # open loop: send time - intended
    loop_lag: Latencies = field(default_factory=Latencies)  # the client's own event-loop delay
    statuses: Counter[str] = field(default_factory=Counter)
    error_samples: dict[str, str] = field(default_factory=dict)  # status → first error body
    items_ok: int = 0
    # Throughput counts OK answers that *arrived* in the window, whenever they were sent (as wrk
    # does); latency statistics cover the requests *intended* in it.
    window_ok: int = 0
    window_items: int = 0
    unfinished: int = 0  # in flight when the window closed (latency recorded as a lower bound)
    unfinished_max_s: float = 0.0  # the oldest of them, then
    completed_s: float = 0.0  # sum of the completed requests' latencies
    bytes_sent: int = 0
    bytes_received: int = 0
    stage_ms: Counter[str] = field(default_factory=Counter)  # Server-Timing sums over OK answers
    timed: int = 0  # OK answers that carried Server-Timing
    window_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time during the window
    cpu_fractions: list[float] = field(default_factory=list)  # per process, of one core
    raw: list[float] | None = None  # every latency recorded in `latency`, when asked (tests)

    @property
    def completed(self) -> int:
        return sum(self.statuses.values())

    @property
    def ok(self) -> int:
        return self.statuses.get("200", 0)

    _HISTOGRAMS = ("latency", "error_latency", "send_lag", "loop_lag")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (histograms encoded) to pass between processes; no raw latencies."""
        out = {k: v for k, v in self.__dict__.items() if k not in self._HISTOGRAMS}
        out.update({k: getattr(self, k).encode() for k in self._HISTOGRAMS})
        out["raw"] = None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        fields = dict(d)
        for k in cls._HISTOGRAMS:
            fields[k] = Latencies(d[k])
        fields["statuses"] = Counter(d["statuses"])
        fields["stage_ms"] = Counter(d["stage_ms"])
        return cls(**fields)

    def merge(self, other: Tally) -> None:
        for name in self._HISTOGRAMS:
            getattr(self, name).merge(getattr(other, name))
        self.statuses.update(other.statuses)
        for status, sample in other.error_samples.items():
            self.error_samples.setdefault(status, sample)
        self.items_ok += other.items_ok
        self.window_ok += other.window_ok
        self.window_items += other.window_items
        self.unfinished += other.unfinished
        self.unfinished_max_s = max(self.unfinished_max_s, other.unfinished_max_s)
        self.completed_s += other.completed_s
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.stage_ms.update(other.stage_ms)
        self.timed += other.timed
        self.window_s = max(self.window_s, other.window_s)
        self.cpu_s += other.cpu_s
        self.cpu_fractions += other.cpu_fractions
