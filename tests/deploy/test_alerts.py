"""The Prometheus alert rules (docker/prometheus/alerts.yml): every expression parses and names
only what a running server exports, every alert carries `for:`, a severity and its annotations,
and is unit-tested both firing and quiet in alerts_test.yml; where promtool is installed
(Debian's `prometheus` package), `promtool check` and `promtool test rules` pass, and the unit
tests fail when a threshold changes under them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.exported import TARGET_LABELS, Exported, exported_metrics, problems

PROMETHEUS = Path(__file__).resolve().parents[2] / "docker" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
UNIT_TESTS = PROMETHEUS / "alerts_test.yml"
# Prometheus's own series about a scrape, not the server's.
SCRAPE_SERIES = {"up": TARGET_LABELS}

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (apt-get install prometheus)"
)


@pytest.fixture(scope="module")
def exported(tiny_config: Path, tiny_checkpoint: Path) -> Exported:
    return exported_metrics(tiny_config, tiny_checkpoint)


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    assert promtool is not None
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_every_expression_parses_and_names_only_exported_metrics(exported: Exported) -> None:
    alerts = _alerts()
    assert len(alerts) >= 6
    found = [
        f"{rule['alert']}: {problem}"
        for rule in alerts
        for problem in problems(rule["expr"], exported, SCRAPE_SERIES)
    ]
    assert not found, "\n".join(found)


def test_the_check_knows_prometheus_own_series_from_the_servers(exported: Exported) -> None:
    assert problems('up{job="clipserve"} == 0', exported, SCRAPE_SERIES) == []
    assert "not exported" in problems('up{job="clipserve"} == 0', exported)[0]
    assert "no label" in problems('up{stage="x"} == 0', exported, SCRAPE_SERIES)[0]


def test_every_alert_has_a_duration_a_severity_and_annotations() -> None:
    for rule in _alerts():
        name = rule["alert"]
        assert "for" in rule, name
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        annotations = rule["annotations"]
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), (name, key)


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert fires == names
    assert quiet == names


def test_prometheus_loads_the_rules_and_scrapes_the_compose_service() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert [PROMETHEUS / name for name in config["rule_files"]] == [RULES]
    services = yaml.safe_load((PROMETHEUS.parent / "compose.yaml").read_text())["services"]
    assert services["prometheus"]["volumes"] == ["./prometheus:/etc/prometheus:ro"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "clipserve"  # ClipserveDown selects up{job="clipserve"}
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in services
    assert any(ports.split(":")[-1] == port for ports in services[host]["ports"])


@needs_promtool
def test_promtool_checks_the_rules_and_the_config() -> None:
    for args in (("check", "rules", RULES.name), ("check", "config", "prometheus.yml")):
        result = _promtool(*args)
        assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = _promtool("test", "rules", UNIT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@needs_promtool
def test_the_unit_tests_fail_when_a_threshold_moves(tmp_path: Path) -> None:
    """The unit tests have teeth: the queue alert's threshold raised past the test's series."""
    rules = RULES.read_text()
    threshold = "(clipserve_estimated_wait_seconds) > 2\n"
    assert rules.count(threshold) == 1
    (tmp_path / RULES.name).write_text(rules.replace(threshold, threshold.replace("2", "5")))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = _promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "ClipserveQueueSaturated" in result.stdout + result.stderr
