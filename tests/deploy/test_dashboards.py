"""The Grafana dashboard (docker/grafana/dashboards/clipserve.json) and its provisioning: every
PromQL expression parses and names only what a running server exports, every panel has a title
and the dashboard's data source, ids are unique, panels do not overlap, and the compose file's
Grafana finds the data source and the dashboard where the provisioning files say."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.exported import Exported, exported_metrics, from_grafana, problems

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "clipserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def exported(tiny_config: Path, tiny_checkpoint: Path) -> Exported:
    return exported_metrics(tiny_config, tiny_checkpoint)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel query and every query variable."""
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(METRIC, LABEL): Grafana's, not PromQL; its metric is checked as one.
            query = variable["query"]["query"]
            assert query.startswith("label_values(") and query.endswith(")"), query
            metric, label = (part.strip() for part in query[len("label_values(") : -1].split(","))
            yield f"variable {variable['name']}", f"count by ({label}) ({metric})"


def test_every_expression_parses_and_names_only_exported_metrics(
    dashboard: dict[str, Any], exported: Exported
) -> None:
    expressions = list(_expressions(dashboard))
    assert len(expressions) > 30  # all of them are read, not none
    found = [
        f"{where}: {problem}"
        for where, expr in expressions
        for problem in problems(from_grafana(expr), exported)
    ]
    assert not found, "\n".join(found)


def test_the_check_rejects_bad_promql_unknown_metrics_and_labels(exported: Exported) -> None:
    good = 'sum by (stage) (rate(clipserve_stage_duration_seconds_count{stage="queue"}[5m]))'
    assert problems(good, exported) == []
    grafana = 'rate(clipserve_items_total{instance=~"$instance"}[$__rate_interval])'
    assert problems(from_grafana(grafana), exported) == []
    assert "does not parse" in problems(grafana, exported)[0]  # hence from_grafana
    bad = {
        "sum(rate(clipserve_requests_total[5m])": "does not parse",  # unclosed
        "rate(clipserve_requests_total)": "does not parse",  # a vector where a range goes
        "rate(clipserve_request_total[5m])": "not exported",  # a typo
        "rate(clipserve_requests[5m])": "not exported",  # a counter without _total
        "clipserve_stage_duration_seconds": "not exported",  # a histogram's family name
        'clipserve_stage_duration_seconds_count{stag="queue"}': "no label 'stag'",
        "sum by (stages) (clipserve_stage_duration_seconds_count)": "by (stages)",
        "sum by (le) (clipserve_stage_duration_seconds_count)": "by (le)",  # not a bucket
        '{__name__=~"clipserve_.*"}': "by its name",
    }
    for expr, why in bad.items():
        found = problems(expr, exported)
        assert len(found) == 1 and why in found[0], (expr, found)


def test_grafana_variables_become_promql() -> None:
    expr = 'rate(clipserve_items_total{instance=~"$instance"}[$__rate_interval])'
    assert from_grafana(expr) == 'rate(clipserve_items_total{instance=~".*"}[5m])'
    assert from_grafana("increase(x[${__range}])") == "increase(x[5m])"


def test_every_panel_has_a_title_the_data_source_and_a_unique_id(
    dashboard: dict[str, Any],
) -> None:
    panels = list(_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), sorted(ids)
    for panel in panels:
        assert panel.get("title"), panel["id"]
        if panel["type"] == "row":
            continue
        assert panel.get("datasource") == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
    (source,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in _panels(dashboard["panels"]):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']!r} overlaps {taken[x, y]!r}"
                taken[x, y] = panel["title"]


def test_the_dashboard_shows_what_an_operator_asks_first(dashboard: dict[str, Any]) -> None:
    """The issue's list: traffic and errors by status and protocol, latency by stage, queue
    depth and wait, batch sizes, device busy ratio, cache, per-key 429s; and liveness."""
    used = " ".join(expr for _, expr in _expressions(dashboard))
    for metric in (
        "clipserve_requests_total",
        "clipserve_stage_duration_seconds_bucket",
        "clipserve_stage_duration_seconds_count",
        "clipserve_queue_depth",
        "clipserve_admitted_items",
        "clipserve_estimated_wait_seconds",
        "clipserve_batch_size_bucket",
        "clipserve_device_busy_seconds_total",
        "clipserve_cache_hits_total",
        "clipserve_cache_misses_total",
        "clipserve_rate_limited_total",
        "clipserve_worker_alive",
        "clipserve_heartbeat_age_seconds",
        "clipserve_restarts_total",
    ):
        assert metric in used, metric


def _exprs(panel: dict[str, Any]) -> str:
    return " ".join(target["expr"] for target in panel.get("targets", []))


def test_a_panel_per_second_plots_a_rate(dashboard: dict[str, Any]) -> None:
    """increase() over $__rate_interval is a count per interval, not per second."""
    for panel in _panels(dashboard["panels"]):
        if "per second" in f"{panel['title']} {panel.get('description', '')}":
            assert "increase(" not in _exprs(panel), panel["title"]


# Recorded for an inference request answered 200 only (clipserve/http/counted.py).
SUCCESSES_ONLY = ("clipserve_stage_duration_seconds", "clipserve_request_bytes", "response_bytes")


def test_panels_of_successes_only_say_so(dashboard: dict[str, Any]) -> None:
    for panel in _panels(dashboard["panels"]):
        if any(metric in _exprs(panel) for metric in SUCCESSES_ONLY):
            assert "answered 200" in panel.get("description", ""), panel["title"]


def test_the_queue_limit_is_shown_on_the_gauge_it_refuses_by(dashboard: dict[str, Any]) -> None:
    """--max-queue-size refuses on clipserve_admitted_items (the queue, plus a place for each
    request being read or looked up in the cache), not on the queue depth alone."""
    named = [
        p for p in _panels(dashboard["panels"]) if "--max-queue-size" in p.get("description", "")
    ]
    assert named
    for panel in named:
        assert "clipserve_admitted_items" in _exprs(panel), panel["title"]


def test_compose_provisions_the_data_source_and_the_dashboard() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    mounts = dict(volume.rsplit(":", 2)[:2] for volume in compose["grafana"]["volumes"])
    assert {(DOCKER / source).resolve() for source in mounts} == {
        DOCKER / "grafana" / "provisioning",
        DOCKER / "grafana" / "dashboards",
    }
    inside = {target: (DOCKER / source).resolve() for source, target in mounts.items()}
    provisioning = inside["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in compose["prometheus"]["ports"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "clipserve.yaml").read_text())[
        "providers"
    ]
    assert (inside[provider["options"]["path"]] / DASHBOARD.name).read_text() == (
        DASHBOARD.read_text()
    )
