"""Triton's model statistics (`GET /v2/models[/{m}]/stats`, gRPC ModelStatistics) from the
server's own counters (metrics.py), summed over every process under --workers N.

The numbers are per tower: every name of a tower (the image model, its per-kind models, their
--served-model-name aliases) reports the image tower's. Stages map onto Triton's as: queue =
the batcher's wait, compute_input = receiving and decoding (parsing included), compute_infer =
the device, compute_output = encoding the answer; success and fail are whole requests.
`execution_count` and `batch_stats` count the batches the tower computed, by size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb

from clipserve.batching.tower import TowerKind
from clipserve.metrics import Metrics
from clipserve.protocol.kserve import VERSION

STAGES = {  # Triton's field: our stages
    "queue": ("queue",),
    "compute_input": ("receive", "decode", "fetch", "cache"),
    "compute_infer": ("compute",),
    "compute_output": ("encode",),
}
_COUNTS = {"count", "ns", "last_inference", "inference_count", "execution_count", "batch_size"}


class Totals:
    """The counters' current sums, read once per answer."""

    def __init__(self, metrics: Metrics) -> None:
        self.requests: dict[tuple[str, str], float] = defaultdict(float)
        self.request_s: dict[tuple[str, str], float] = defaultdict(float)
        self.stage_s: dict[tuple[str, str], float] = defaultdict(float)
        self.items: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = defaultdict(float)
        self.batches: dict[str, dict[int, list[float]]] = defaultdict(dict)
        names = (
            "clipserve_model_requests_total",
            "clipserve_model_request_seconds_total",
            "clipserve_model_stage_seconds_total",
            "clipserve_model_items_total",
            "clipserve_model_last_inference_seconds",
            "clipserve_batches_total",
            "clipserve_batch_seconds_total",
        )
        for sample in metrics.samples(*names):
            labels, value = sample.labels, sample.value
            tower = labels.get("tower", "")
            if sample.name == "clipserve_model_requests_total":
                self.requests[tower, labels["outcome"]] += value
            elif sample.name == "clipserve_model_request_seconds_total":
                self.request_s[tower, labels["outcome"]] += value
            elif sample.name == "clipserve_model_stage_seconds_total":
                self.stage_s[tower, labels["stage"]] += value
            elif sample.name == "clipserve_model_items_total":
                self.items[tower] += value
            elif sample.name == "clipserve_model_last_inference_seconds":
                self.last[tower] = max(self.last[tower], value)
            else:
                size = self.batches[tower].setdefault(int(labels["size"]), [0.0, 0.0])
                size[0 if sample.name == "clipserve_batches_total" else 1] += value

    def model(self, name: str, tower: TowerKind) -> pb.ModelStatistics:
        successes = int(self.requests[tower, "success"])
        stats = pb.InferStatistics()
        stats.success.count = successes
        stats.success.ns = _ns(self.request_s[tower, "success"])
        stats.fail.count = int(self.requests[tower, "fail"])
        stats.fail.ns = _ns(self.request_s[tower, "fail"])
        for field, ours in STAGES.items():
            duration = getattr(stats, field)
            duration.count = successes
            duration.ns = _ns(sum(self.stage_s[tower, stage] for stage in ours))
        batches = self.batches[tower]
        model = pb.ModelStatistics(
            name=name,
            version=VERSION,
            last_inference=int(self.last[tower] * 1000),
            inference_count=int(self.items[tower]),
            execution_count=int(sum(count for count, _ in batches.values())),
            inference_stats=stats,
        )
        for size, (count, seconds) in sorted(batches.items()):
            batch = model.batch_stats.add(batch_size=size)
            batch.compute_infer.count = int(count)
            batch.compute_infer.ns = _ns(seconds)
        return model


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def model_statistics(
    metrics: Metrics, models: Iterable[tuple[str, TowerKind]]
) -> pb.ModelStatisticsResponse:
    totals = Totals(metrics)
    return pb.ModelStatisticsResponse(model_stats=[totals.model(n, t) for n, t in models])


def statistics_json(response: pb.ModelStatisticsResponse) -> dict[str, Any]:
    """Triton's HTTP form: the message's JSON with its 64-bit counts as numbers (protobuf's
    JSON writes them as strings) and every count present, zero included."""
    doc = json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(doc)  # type: ignore[no-any-return]


def _numbers(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: int(v) if k in _COUNTS and isinstance(v, str) else _numbers(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value
