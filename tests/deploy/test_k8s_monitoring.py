"""Who scrapes the pods in Kubernetes (docker/k8s/monitoring): both autoscaling components query
the Prometheus Operator's Prometheus, which ignores the pods' prometheus.io/* annotations and
scrapes only what a PodMonitor selects; so every variant ships one, selecting the Deployment's
pods on the port and path the annotations name, and its series carry the labels the queries and
the alert rules select on (`namespace`, `pod`; job="clipserve", as Compose's scrape job)."""

from __future__ import annotations

import re
import shutil
from typing import Any

import pytest
import yaml

from tests.deploy.test_k8s import ADAPTER_VALUES, K8S, OVERLAYS, Manifest, kustomize, one

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")

ALERTS = K8S.parent / "prometheus" / "alerts.yml"
OPERATOR_PROMETHEUS = "prometheus-operated.monitoring.svc"  # kube-prometheus-stack's Service


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Manifest]]:
    """Each overlay as shipped (KEDA) and with the HPA component instead."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree)
    built = {}
    for overlay in OVERLAYS:
        path = tree / overlay / "kustomization.yaml"
        path.write_text(
            path.read_text().replace("- ../autoscaling/keda\n", "- ../autoscaling/hpa\n")
        )
        built[f"{overlay}+keda"] = kustomize(K8S / overlay)
        built[f"{overlay}+hpa"] = kustomize(tree / overlay)
    return built


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus's `replace` relabeling (the only action used here) applied to `labels`."""
    out = dict(labels)
    for config in configs:
        assert config.get("action", "replace") == "replace", config
        value = config.get("separator", ";").join(
            out.get(n, "") for n in config.get("sourceLabels", [])
        )
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        if match:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", config.get("replacement", "$1"))
            out[config["targetLabel"]] = match.expand(replacement)
    return out


def _alert_jobs() -> set[str]:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    return {job for r in rules for job in re.findall(r'job="([^"]+)"', r["expr"])}


@pytest.mark.parametrize("variant", [f"{o}+{s}" for o in OVERLAYS for s in ("keda", "hpa")])
def test_a_podmonitor_scrapes_what_the_autoscaler_and_alerts_read(
    variants: dict[str, list[Manifest]], variant: str
) -> None:
    objects = variants[variant]
    if variant.endswith("keda"):
        [trigger] = one(objects, "ScaledObject")["spec"]["triggers"]
        address = trigger["metadata"]["serverAddress"]
    else:
        address = yaml.safe_load(ADAPTER_VALUES.read_text())["prometheus"]["url"]
    assert OPERATOR_PROMETHEUS in address  # the Operator's Prometheus: it needs a PodMonitor

    monitor = one(objects, "PodMonitor")
    namespace = one(objects, "Namespace")["metadata"]["name"]
    assert monitor["metadata"]["namespace"] == namespace  # it selects pods in its own
    pod = one(objects, "Deployment")["spec"]["template"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector and all(pod["metadata"]["labels"].get(k) == v for k, v in selector.items())

    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [main] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    annotations = pod["metadata"]["annotations"]
    assert ports[endpoint["port"]] == int(annotations["prometheus.io/port"])
    assert endpoint["path"] == annotations["prometheus.io/path"] == "/metrics"

    # The labels the Operator gives a PodMonitor's target, then the endpoint's relabelings.
    target = {"job": f"{namespace}/{monitor['metadata']['name']}", "namespace": namespace}
    target |= {"pod": "clipserve-0", "endpoint": endpoint["port"]}
    labelled = relabel(target, endpoint.get("relabelings", []))
    assert {"namespace", "pod"} <= set(labelled)  # what KEDA's and the adapter's queries use
    assert _alert_jobs() == {labelled["job"]} == {"clipserve"}  # up{job="clipserve"}


def test_relabel_follows_prometheus() -> None:
    labels = {"job": "ns/x", "pod": "p-1"}
    assert relabel(labels, [{"targetLabel": "job", "replacement": "clipserve"}])["job"] == (
        "clipserve"
    )
    copy = [{"sourceLabels": ["pod"], "regex": "p-(.*)", "targetLabel": "n", "replacement": "$1"}]
    assert relabel(labels, copy)["n"] == "1"
    assert (
        relabel(labels, [{"sourceLabels": ["pod"], "regex": "q", "targetLabel": "job"}]) == labels
    )
