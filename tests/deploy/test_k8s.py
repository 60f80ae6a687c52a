"""The Kubernetes manifests (docker/k8s): every variant, cpu and gpu each with KEDA or with an
HPA on prometheus-adapter, builds with `kubectl kustomize`; every object validates offline
against the Kubernetes schemas (kubernetes-validate, strict: an unknown field fails, as
`kubectl apply`'s server-side field validation does), the ScaledObject and the PodMonitor
against KEDA's and the Prometheus Operator's CRD schemas (tests/deploy/schemas); and the
objects agree with each other and with the server: the probes' paths answer, the scaling
metric is exported, the grace period covers the drain, the liveness probe outlasts the
supervisor's own restart, /dev/shm holds every front end's slots.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema
import kubernetes_validate
import open_clip
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from clipserve.config import (
    ServerConfig,
    iter_options,
    load_config,
    resolve_device_defaults,
    validate,
)
from clipserve.engine.heartbeat import restart_deadline_s
from clipserve.engine.messages import ModelCard
from clipserve.engine.remote import slot_bytes, slot_count
from tests.deploy.exported import Exported, exported_metrics, problems
from tests.helpers import RunningServer

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")

K8S = Path(__file__).parents[2] / "docker" / "k8s"
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {  # (apiVersion, kind): its CRD's openAPIV3Schema
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "keda-scaledobject-v1alpha1.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "prometheus-operator-podmonitor-v1.yaml",
}
ADAPTER_VALUES = K8S / "autoscaling" / "hpa" / "prometheus-adapter-values.yaml"
OVERLAYS = ("cpu", "gpu")
AUTOSCALERS = ("keda", "hpa")
# 1.30: the oldest we validate against; and the newest shipped.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# Labels that Prometheus's kubernetes-pods job (and a PodMonitor) add to every series.
POD_TARGET_LABELS = frozenset({"namespace", "pod"})

Manifest = dict[str, Any]


def kustomize(directory: Path) -> list[Manifest]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Manifest]]:
    """Objects by variant ("cpu+keda"), every overlay with each autoscaler: as shipped
    (KEDA), and in a copy of the tree with the other component, as the README says to swap."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree)
    built = {}
    for overlay in OVERLAYS:
        shipped = (K8S / overlay / "kustomization.yaml").read_text()
        assert "- ../autoscaling/keda\n" in shipped
        swapped = shipped.replace("- ../autoscaling/keda\n", "- ../autoscaling/hpa\n")
        (tree / overlay / "kustomization.yaml").write_text(swapped)
        built[f"{overlay}+keda"] = kustomize(K8S / overlay)
        built[f"{overlay}+hpa"] = kustomize(tree / overlay)
    return built


VARIANTS = [f"{overlay}+{scaler}" for overlay in OVERLAYS for scaler in AUTOSCALERS]


def one(objects: list[Manifest], kind: str) -> Manifest:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def container(objects: list[Manifest]) -> Manifest:
    [found] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return cast(Manifest, found)


# ---- schemas ---------------------------------------------------------------------------------


def _closed(schema: Any) -> Any:
    """A CRD schema as the API server applies it: fields it does not declare are rejected
    (`kubectl apply` validates strictly), except where it preserves unknown fields."""
    if isinstance(schema, dict):
        closed = {key: _closed(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            closed["additionalProperties"] = False
        return closed
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


@functools.cache
def crd_validator(path: Path) -> jsonschema.protocols.Validator:
    schema = _closed(yaml.safe_load(path.read_text()))
    # ObjectMeta is the API server's to check, as for every kind; the CRD leaves it open.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(schema)


def schema_problems(manifest: Manifest, version: str) -> list[str]:
    """Where `manifest` breaks its kind's schema for Kubernetes `version`."""
    where = f"{manifest['kind']}/{manifest['metadata']['name']}"
    crd = CRD_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
    if crd is not None:
        return [
            f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(crd).iter_errors(manifest)
        ]
    try:
        kubernetes_validate.validate(manifest, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where} ({version}): {'.'.join(map(str, e.path))}: {e.message}"]
    except SchemaNotFoundError as e:
        return [f"{where}: {e.message}"]
    return []


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates(
    variants: dict[str, list[Manifest]], variant: str, version: str
) -> None:
    objects = variants[variant]
    kinds = sorted(o["kind"] for o in objects)
    scaler = "ScaledObject" if variant.endswith("keda") else "HorizontalPodAutoscaler"
    expected = ["ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Service", scaler]
    expected.append("PodMonitor")
    assert kinds == sorted(expected)
    assert [p for o in objects for p in schema_problems(o, version)] == []


def _parent(manifest: Manifest, path: str) -> tuple[Manifest, Any, str]:
    """A copy of `manifest`, the node in it holding `path`'s last key, and that key."""
    copied = copy.deepcopy(manifest)
    *parents, last = path.split(".")
    node: Any = copied
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    return copied, node, last


def _set(manifest: Manifest, path: str, value: Any) -> Manifest:
    broken, node, key = _parent(manifest, path)
    node[int(key) if isinstance(node, list) else key] = value
    return broken


def _rename(manifest: Manifest, path: str, new: str) -> Manifest:
    broken, node, key = _parent(manifest, path)
    node[new] = node.pop(key)
    return broken


CONTAINER = "spec.template.spec.containers.0"


@pytest.mark.parametrize(
    ("kind", "breaks", "named"),
    [
        ("Deployment", lambda o: _set(o, "spec.strategy.rollingUpdate.maxSurge", [1]), "maxSurge"),
        ("Deployment", lambda o: _set(o, f"{CONTAINER}.ports.0.containerPort", "http"), "port"),
        ("Deployment", lambda o: _rename(o, f"{CONTAINER}.livenessProbe", "livenesProbe"), "live"),
        ("Service", lambda o: _rename(o, "spec.selector", "selecter"), "selecter"),
        ("ScaledObject", lambda o: _set(o, "spec.minReplicaCount", "2"), "minReplicaCount"),
        ("ScaledObject", lambda o: _rename(o, "spec.triggers.0.metadata", "metdata"), "metdata"),
        ("ScaledObject", lambda o: _set(o, "spec.triggers.0.metadata.threshold", 32), "threshold"),
        ("PodMonitor", lambda o: _rename(o, "spec.podMetricsEndpoints", "endpoints"), "endpoints"),
        ("PodMonitor", lambda o: _set(o, "spec.podMetricsEndpoints.0.path", 1), "path"),
    ],
    ids=[
        "deployment-type",
        "port-type",
        "deployment-unknown-field",
        "service-unknown-field",
        "scaledobject-type",
        "scaledobject-unknown-field",
        "scaledobject-metadata-not-string",
        "podmonitor-unknown-field",
        "podmonitor-type",
    ],
)
def test_a_broken_object_is_caught(
    variants: dict[str, list[Manifest]], kind: str, breaks: Any, named: str
) -> None:
    """The validation can fail: a wrong type or a misspelt field in a real object is named."""
    manifest = one(variants["gpu+keda"], kind)
    assert schema_problems(manifest, KUBERNETES_VERSIONS[-1]) == []
    found = schema_problems(breaks(manifest), KUBERNETES_VERSIONS[-1])
    assert found, f"{kind}: the broken copy validated"
    assert named in " ".join(found), found


# ---- the objects agree with each other -------------------------------------------------------


def _matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("variant", VARIANTS)
def test_selectors_names_and_ports_agree(variants: dict[str, list[Manifest]], variant: str) -> None:
    objects = variants[variant]
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert namespaces == {one(objects, "Namespace")["metadata"]["name"]}

    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], labels)
    assert _matches(one(objects, "Service")["spec"]["selector"], labels)
    assert _matches(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)

    main = container(objects)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    env, http = server_env(objects), served_config(objects).http
    assert http.grpc_port != 0  # gRPC is on (the image's default, 8001)
    assert ports == {"http": int(env["CLIPSERVE_PORT"]), "grpc": http.grpc_port}
    assert env["CLIPSERVE_HOST"] == "0.0.0.0"  # reachable from the kubelet and the Service
    service = {p["targetPort"]: p["port"] for p in one(objects, "Service")["spec"]["ports"]}
    assert service == {"http": 80, "grpc": http.grpc_port}  # gRPC on Triton's port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"]["port"] in ports
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == ports["http"]

    scaler = next(o for o in objects if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler"))
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"


def server_env(objects: list[Manifest]) -> dict[str, str]:
    """The CLIPSERVE_* variables the container gets: its ConfigMap's, then its own."""
    main = container(objects)
    [source] = main["envFrom"]
    config_map = one(objects, "ConfigMap")
    assert source["configMapRef"]["name"] == config_map["metadata"]["name"]
    env = dict(config_map["data"])
    env.update({e["name"]: e["value"] for e in main.get("env", ())})
    return {k: v for k, v in env.items() if k.startswith("CLIPSERVE_")}


def devices(objects: list[Manifest]) -> list[str]:
    gpus = int(container(objects)["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    return [f"cuda:{i}" for i in range(gpus)] or ["cpu"]


def served_config(objects: list[Manifest]) -> ServerConfig:
    """The config the server builds from this pod's variables, its device defaults resolved."""
    env = server_env(objects)
    known = {option.env for option in iter_options()}
    assert sorted(set(env) - known) == [], "variables the server does not read"
    config = load_config({}, environ=env)
    validate(config)  # what the server would refuse at start-up, refused here
    return resolve_device_defaults(config, devices(objects))


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_pod_fits_the_server(variants: dict[str, list[Manifest]], variant: str) -> None:
    objects = variants[variant]
    config = served_config(objects)
    main = container(objects)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]

    # Devices: as many GPUs as the pod is given, and a GPU's request equal to its limit.
    resources = main["resources"]
    gpus = resources.get("limits", {}).get("nvidia.com/gpu")
    assert resources["requests"].get("nvidia.com/gpu") == gpus
    wanted = config.backend.gpus
    assert wanted == ("cpu" if gpus is None else ",".join(map(str, range(int(gpus)))))

    # SIGTERM: serving on while the endpoint removal spreads, then --drain-timeout-s for
    # in-flight requests, within the grace period, with time left for the engine's own exit.
    pause = config.http.shutdown_delay_s
    assert pause >= 3  # kube-proxy and ingress controllers take seconds to drop an endpoint
    assert pod["terminationGracePeriodSeconds"] >= pause + config.http.drain_timeout_s + 5

    # Liveness fails only once the supervisor should have replaced a silent engine (a dead
    # one being restarted stays live while it loads the model); start-up grants the load.
    def tolerance(probe: str) -> float:
        return float(main[probe]["periodSeconds"] * main[probe]["failureThreshold"])

    restart = restart_deadline_s(config.http.heartbeat_timeout_s)
    assert tolerance("livenessProbe") >= restart + main["livenessProbe"]["periodSeconds"]
    assert tolerance("startupProbe") >= max(300, tolerance("livenessProbe"))
    assert main["startupProbe"]["httpGet"]["path"] == main["livenessProbe"]["httpGet"]["path"]

    # /dev/shm holds every front end's slot file with all its pages allocated.
    model = open_clip.get_model_config(config.model.model)
    size = model["vision_cfg"]["image_size"]
    card = cast(
        ModelCard,
        {
            "preprocess": {"size": (size, size)},
            "context_length": model["text_cfg"]["context_length"],
            "embed_dim": model["embed_dim"],
        },
    )
    per_front_end = slot_count(config, len(devices(objects))) * -(-slot_bytes(card) // 64) * 64
    [shm] = [v for v in pod["volumes"] if v["name"] == "shm"]
    [mount] = [m for m in main["volumeMounts"] if m["name"] == "shm"]
    assert mount["mountPath"] == "/dev/shm"
    assert shm["emptyDir"]["medium"] == "Memory"
    limit = quantity(shm["emptyDir"]["sizeLimit"])
    assert limit >= config.http.workers * per_front_end, f"{per_front_end / 2**20:.1f} MiB"
    assert quantity(resources["limits"]["memory"]) >= limit + 3 * 2**30  # + the processes

    # CPU inference: intra-op threads within the cores requested.
    if wanted == "cpu":
        assert 1 <= config.backend.threads <= quantity(resources["requests"]["cpu"])
    # Service links would put CLIPSERVE_PORT=tcp://<ip>:80 (the Service's) into the pod.
    assert pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"] for m in main["volumeMounts"]}
    assert {"/tmp", "/dev/shm", str(Path(config.model.cache_dir).parent)} <= writable


# The idle timeout of the balancers most often in front of the pods: ingress-nginx's upstream
# keep-alive and AWS ALB's default. A server closing idle connections sooner races the balancer
# reusing one: a request sent as the server closes is a 502.
BALANCER_IDLE_TIMEOUT_S = 60


@pytest.mark.parametrize("variant", VARIANTS)
def test_keep_alive_outlasts_the_balancers_idle_timeout(
    variants: dict[str, list[Manifest]], variant: str
) -> None:
    objects = variants[variant]
    assert float(server_env(objects)["CLIPSERVE_KEEP_ALIVE_TIMEOUT_S"]) > BALANCER_IDLE_TIMEOUT_S
    assert served_config(objects).http.keep_alive_timeout_s > BALANCER_IDLE_TIMEOUT_S


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity ("1088Mi", "4", "500m") as a number."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert match, text
    number, suffix = match.groups()
    return float(number) * (1e-3 if suffix == "m" else _SUFFIX.get(suffix, 1) if suffix else 1)


# ---- autoscaling: on a metric the server exports ---------------------------------------------


def scaling(objects: list[Manifest]) -> tuple[str, float, int, int]:
    """(the PromQL or metric name it scales on, the per-replica target, min, max replicas)."""
    if any(o["kind"] == "ScaledObject" for o in objects):
        spec = one(objects, "ScaledObject")["spec"]
        [trigger] = spec["triggers"]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
        meta = trigger["metadata"]
        return (
            meta["query"],
            float(meta["threshold"]),
            spec["minReplicaCount"],
            spec["maxReplicaCount"],
        )
    spec = one(objects, "HorizontalPodAutoscaler")["spec"]
    [metric] = spec["metrics"]
    assert (metric["type"], metric["pods"]["target"]["type"]) == ("Pods", "AverageValue")
    target = quantity(metric["pods"]["target"]["averageValue"])
    return metric["pods"]["metric"]["name"], target, spec["minReplicas"], spec["maxReplicas"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_scaling_target_sits_between_a_batch_and_a_full_queue(
    variants: dict[str, list[Manifest]], variant: str
) -> None:
    """Scale out once a replica has a whole batch waiting, long before its queue is full
    (503s); and never below two replicas, so a PDB-permitted eviction keeps one serving."""
    objects = variants[variant]
    batching = served_config(objects).batching
    _, target, low, high = scaling(objects)
    assert batching.max_batch_size <= target <= batching.max_queue_size / 4
    pdb = one(objects, "PodDisruptionBudget")["spec"]
    assert 2 <= low <= high
    assert pdb["maxUnavailable"] < low


def _with_pod_labels(exported: Exported) -> Exported:
    return Exported(
        {k: None if v is None else v | POD_TARGET_LABELS for k, v in exported.labels.items()}
    )


def _adapter_rule() -> dict[str, Any]:
    [rule] = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return cast(dict[str, Any], rule)


def test_autoscaling_queries_name_what_the_server_exports(
    variants: dict[str, list[Manifest]], tiny_config: Path, tiny_checkpoint: Path
) -> None:
    """KEDA's query and prometheus-adapter's rule parse and select only metrics the server
    exports (labels: its own, and the pod's that Prometheus adds); the adapter serves the
    metric under the name the HPA asks for; KEDA selects the manifests' namespace."""
    exported = _with_pod_labels(exported_metrics(tiny_config, tiny_checkpoint))
    for overlay in OVERLAYS:
        namespace = one(variants[f"{overlay}+keda"], "Namespace")["metadata"]["name"]
        query, *_ = scaling(variants[f"{overlay}+keda"])
        assert problems(query, exported) == []
        assert f'namespace="{namespace}"' in query

        hpa_metric, *_ = scaling(variants[f"{overlay}+hpa"])
        rule = _adapter_rule()
        assert problems(rule["seriesQuery"], exported) == []
        series = re.match(r"\w+", rule["seriesQuery"])
        assert series is not None
        assert re.sub(rule["name"]["matches"], rule["name"]["as"], series[0]) == hpa_metric
        assert set(rule["resources"]["overrides"]) == POD_TARGET_LABELS
        # The adapter's template filled in as it fills it for a pods metric.
        filled = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series[0])
            .replace("<<.LabelMatchers>>", f'namespace="{namespace}",pod=~"clipserve-.*"')
            .replace("<<.GroupBy>>", "pod")
        )
        assert "<<" not in filled
        assert problems(filled, exported) == []
        assert hpa_metric in query, "KEDA and the HPA scale on the same metric"


def test_probe_and_scrape_paths_answer_on_a_server(
    variants: dict[str, list[Manifest]], serve: Any
) -> None:
    """The paths the probes and Prometheus use, on a real server: 200 each, and /metrics
    carries the metric both autoscalers scale on."""
    server: RunningServer = serve(backend="fake")
    objects = variants["gpu+keda"]
    main = container(objects)
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    paths = {
        main[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert paths == {"/healthz", "/readyz"}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path in sorted(paths | {annotations["prometheus.io/path"]}):
            assert client.get(path).status_code == 200, path
        families = re.findall(r"^# TYPE (\w+) gauge$", client.get("/metrics").text, re.M)
    hpa_metric, *_ = scaling(variants["gpu+hpa"])
    assert hpa_metric in families
