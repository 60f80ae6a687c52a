"""What the server really exports, and the PromQL check that test_dashboards.py and
test_alerts.py share: every expression parses (promql-parser, the Rust PromQL parser with its
type checks) and selects only metric and label names that a running server's /metrics shows.

The names come from a fake-backend server on a loopback port after one request of each kind
(JPEG, text, OpenAI text, a cache hit, a 429), and from the supervisor's liveness metrics
(`--workers N` only: heartbeat ages, restarts) written to a multiprocess directory and read as a
front end's /metrics reads them.
"""

from __future__ import annotations

import functools
import io
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import promql_parser
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from clipserve.engine.heartbeat import LivenessMetrics
from tests.helpers import make_config, running

# Labels that Prometheus adds to every scraped series (the target's), not in /metrics.
TARGET_LABELS = frozenset({"job", "instance"})
# The sample names of each metric type, from its family's name.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


@dataclass(frozen=True)
class Exported:
    """Sample name -> its label names; None where the family is declared (HELP and TYPE) but
    has no sample yet, so its labels are unknown."""

    labels: Mapping[str, frozenset[str] | None]


def _families(text: str) -> Iterator[tuple[str, frozenset[str] | None]]:
    for family in text_string_to_metric_families(text):
        by_name: dict[str, set[str]] = {}
        for sample in family.samples:
            by_name.setdefault(sample.name, set()).update(sample.labels)
        for suffix in _SUFFIXES.get(family.type, ("",)):
            name = family.name + suffix
            seen = by_name.get(name)
            yield name, frozenset(seen) if seen is not None else None


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (30, 90, 150)).save(out, "JPEG")
    return out.getvalue()


def _served_metrics(tiny_config: Path, tiny_checkpoint: Path) -> str:
    # A tiny rate refill: after a burst of 4 items the next request is refused (429).
    config = make_config(
        tiny_config, tiny_checkpoint, backend="fake", cache_mb="16", rate_limit="0.01:4"
    )
    with running(config) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        jpeg = {"content-type": "image/jpeg"}
        for _ in range(2):  # the second from the cache
            assert client.post("/embed", content=_jpeg(), headers=jpeg).status_code == 200
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"input": "a photo of a cat", "model": model}
        assert client.post("/v1/embeddings", json=body).status_code == 200
        statuses = [client.post("/embed/text", json={"texts": ["a dog"]}).status_code]
        while statuses[-1] == 200 and len(statuses) < 20:
            statuses.append(client.post("/embed/text", json={"texts": ["a dog"]}).status_code)
        assert statuses[-1] == 429, statuses
        return client.get("/metrics").text


def _supervisor_metrics() -> str:
    with tempfile.TemporaryDirectory() as directory:
        liveness = LivenessMetrics(Path(directory))
        try:
            liveness.ages({"engine": 0.2, "frontend-0": 0.1})
            liveness.restarted("engine", "hung")
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]
            return generate_latest(registry).decode()
        finally:
            liveness.close()


@functools.cache
def exported_metrics(tiny_config: Path, tiny_checkpoint: Path) -> Exported:
    """Scraped once per session (both test modules ask)."""
    text = _served_metrics(tiny_config, tiny_checkpoint) + _supervisor_metrics()
    return Exported(dict(_families(text)))


_INTERVAL_VARIABLE = re.compile(r"\$(?:__\w+|\{__\w+\})")
_VARIABLE = re.compile(r"\$(?:\w+|\{\w+\})")


def from_grafana(expr: str) -> str:
    """PromQL with Grafana's variables replaced: intervals ($__rate_interval, $__range) by a
    duration, the dashboard's own ($instance) by a regex matching anything."""
    return _VARIABLE.sub(".*", _INTERVAL_VARIABLE.sub("5m", expr))


def _selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(expr, pre_visit=visit)
    return found


def problems(
    expr: str, exported: Exported, extra: Mapping[str, frozenset[str]] | None = None
) -> list[str]:
    """What is wrong with `expr`: a parse or type error, a metric the server does not export,
    a label that metric does not have (in a matcher or an aggregation's `by`). `extra`: series
    that are not the server's but Prometheus's own (`up`), with their labels."""
    try:
        parsed = promql_parser.parse(expr)
    except ValueError as error:
        return [f"does not parse: {error}"]
    known: dict[str, frozenset[str] | None] = {**exported.labels, **(extra or {})}
    found: list[str] = []

    def labels_of(selectors: list[promql_parser.VectorSelector]) -> frozenset[str] | None:
        """The label names these selectors' series can carry; None if any is unknown."""
        union: set[str] = set(TARGET_LABELS)
        for selector in selectors:
            labels = known.get(selector.name or "")
            if labels is None:
                return None
            union |= labels
        return frozenset(union)

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name is None:
                found.append(f"{node}: select a metric by its name")
            elif node.name not in known:
                found.append(f"{node.name}: not exported by the server")
            else:
                have = labels_of([node])
                for matcher in node.matchers.matchers:
                    if have is not None and matcher.name not in have:
                        found.append(f"{node.name} has no label {matcher.name!r}")
        elif (
            isinstance(node, promql_parser.AggregateExpr)
            and node.modifier is not None
            and node.modifier.type == promql_parser.AggModifierType.By
        ):
            have = labels_of(_selectors(node.expr))
            for label in node.modifier.labels:
                if have is not None and label not in have:
                    found.append(f"by ({label}): no metric under it has that label")

    promql_parser.walk(parsed, pre_visit=visit)
    return found
