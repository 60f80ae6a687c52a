"""An answered request's metrics (http/counted.py) read as the same updates made one at a time
through prometheus_client, label by label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from clipserve.http.counted import RequestMetrics
from clipserve.metrics import Metrics

TENSOR = {"receive": 0.0001, "queue": 0.002, "compute": 0.001}
JPEG = {"receive": 0.0002, "decode": 0.003, "queue": 0.01}
TEXT = {"decode": 0.0004, "compute": 0.005, "encode": 0.0}
LATE = {"receive": 1e-7, "queue": 30.5, "compute": 0.2}
# tower, protocol, seconds, stages, items, body bytes, answer bytes
REQUESTS = [
    ("image", "raw-tensor", 0.004, TENSOR, 1, 150528, 6100),
    ("image", "jpeg", 0.02, JPEG, 1, 52000, 6080),
    ("text", "openai-text", 0.007, TEXT, 3, 90, 18000),
    ("image", "raw-tensor", 31.0, LATE, 64, 9633792, 390000),
]


def _exposition(m: Metrics) -> list[str]:
    lines = generate_latest(m.registry).decode().splitlines()
    skip = ("_created", "clipserve_model_last_inference_seconds{")  # times differ
    return [line for line in lines if not line.startswith(skip) and "_created" not in line]


def test_a_request_counts_as_one_at_a_time_updates() -> None:
    deferred, direct = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    counted = RequestMetrics(deferred)
    for tower, protocol, seconds, stages, items, body, answer in REQUESTS:
        counted.succeeded(tower, protocol, seconds, stages, items, body, answer)
        d = direct
        d.model_requests.labels(tower, "success").inc()
        d.model_request_seconds.labels(tower, "success").inc(seconds)
        d.model_items.labels(tower).inc(items)
        d.request_bytes.labels(protocol).inc(body)
        d.response_bytes.labels(protocol).inc(answer)
        for stage, spent in stages.items():
            d.model_stage_seconds.labels(tower, stage).inc(spent)
            d.stage_duration.labels(stage, protocol).observe(spent)
    counted.failed("text", 0.5)
    direct.model_requests.labels("text", "fail").inc()
    direct.model_request_seconds.labels("text", "fail").inc(0.5)
    assert _exposition(deferred) == _exposition(direct)
    last = deferred.registry.get_sample_value(
        "clipserve_model_last_inference_seconds", {"tower": "image"}
    )
    assert last is not None and last > 1.7e9  # set, as Unix time
