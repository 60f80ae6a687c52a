"""--otel-endpoint: a server span per request (HTTP) or call (gRPC, the real `tritonclient.grpc`)
with its stages as children, exported over OTLP/HTTP to a collector (here a real one on a
loopback port, decoding what the SDK sends)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from clipserve.config import load_config
from clipserve.errors import ConfigError
from clipserve.http.observer import request_tracing
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    cli_server,
    free_port,
    marked_png,
    model_name,
    until,
)

needs_otel = pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.sdk") is None,
    reason="the otel extra is not installed",
)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
GRPC_SERVICE = "inference.GRPCInferenceService"
STAGES = {"receive", "decode", "queue", "compute", "encode"}
SERVER_KIND = 2  # SpanKind.SPAN_KIND_SERVER in OTLP
ERROR_STATUS = 2  # Status.STATUS_CODE_ERROR


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status: int
    trace_state: str
    attributes: dict[str, Any]
    pid: int  # the exporting process's (its resource's process.pid)
    resource: dict[str, Any]  # the exporting process's resource: service.name and the rest


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver: the spans every POST to /v1/traces carried."""

    url: str = ""
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    span = Span(
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.name,
                        s.kind,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        s.status.code,
                        s.trace_state,
                        _attributes(s.attributes),
                        int(resource["process.pid"]),
                        resource,
                    )
                    with self.lock:
                        self.spans.append(span)

    def request(self, request_id: str) -> Span | None:
        """The server span of the request with this id, once exported."""
        with self.lock:
            return next(
                (
                    s
                    for s in self.spans
                    if s.kind == SERVER_KIND
                    and s.attributes.get("clipserve.request_id") == request_id
                ),
                None,
            )

    def children(self, parent: Span) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.parent == parent.span_id]


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in pairs}


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[Collector]:
    # The SDK's batches leave every 50 ms rather than every 5 s (read by BatchSpanProcessor, in
    # this process and in the servers started from it).
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    # The resource as the test sets it, whatever the shell running the tests exports.
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    received = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/traces":
                self.send_response(404)
            else:
                received.take(body)
                self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    received.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()
        # Tracing is one per process and endpoint: a later collector given this port again
        # gets a provider read from its own test's variables.
        request_tracing.cache_clear()


def _server_timing(header: str) -> dict[str, float]:
    """Server-Timing's stages, in ms."""
    stages = {}
    for part in header.split(","):
        name, _, duration = part.strip().partition(";dur=")
        stages[name] = float(duration)
    return stages


@needs_otel
def test_a_request_is_a_server_span_with_its_stages_inside(
    serve: Serve, collector: Collector
) -> None:
    server = serve(backend="fake", otel_endpoint=collector.url)
    headers = {**PNG, "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "X-Request-Id": "traced"}
    r = httpx.post(server.url + "/embed", content=marked_png(1), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    until(lambda: collector.request("traced") is not None, 30, "the request's span exported")
    span = collector.request("traced")
    assert span is not None

    # The caller's trace, its span the parent; HTTP's semantic attributes.
    assert (span.trace_id, span.parent) == (TRACE_ID, CALLER_SPAN)
    assert span.name == "POST /embed"
    assert span.attributes["http.request.method"] == "POST"
    assert span.attributes["http.route"] == "/embed"
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["clipserve.items"] == 1
    assert span.status != ERROR_STATUS
    assert span.resource["service.name"] == "clipserve"  # no OTEL_SERVICE_NAME: the default

    # One child per stage the answer's Server-Timing reports, as long as it says, inside the
    # request's span.
    timing = _server_timing(r.headers["Server-Timing"])
    total_ms = timing.pop("total")
    until(lambda: len(collector.children(span)) == len(timing), 30, "the stages exported")
    children = {c.name: c for c in collector.children(span)}
    assert children.keys() == timing.keys()
    assert children.keys() >= STAGES
    for name, child in children.items():
        assert child.trace_id == TRACE_ID
        assert span.start_ns <= child.start_ns <= child.end_ns <= span.end_ns, name
        assert abs((child.end_ns - child.start_ns) / 1e6 - timing[name]) < 0.002, name
    # The span ends once the answer is sent, a little after Server-Timing's total is taken.
    assert (span.end_ns - span.start_ns) / 1e6 > total_ms - 1


@needs_otel
def test_the_standard_variables_name_the_service(
    serve: Serve, collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_SERVICE_NAME names the service, over OTEL_RESOURCE_ATTRIBUTES' service.name (as
    the specification orders them), whose other attributes reach the collector too."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "clip-images")
    attributes = "service.name=ignored,deployment.environment.name=staging"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", attributes)
    server = serve(backend="fake", otel_endpoint=collector.url)
    headers = {**PNG, "X-Request-Id": "named"}
    r = httpx.post(server.url + "/embed", content=marked_png(1), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    until(lambda: collector.request("named") is not None, 30, "the request's span exported")
    span = collector.request("named")
    assert span is not None
    assert span.resource["service.name"] == "clip-images"
    assert span.resource["deployment.environment.name"] == "staging"


@needs_otel
def test_errors_and_requests_without_a_caller_start_their_own_trace(
    serve: Serve, collector: Collector
) -> None:
    server = serve(backend="fake", backend_option=["fail_pixel=7"], otel_endpoint=collector.url)
    bad = httpx.post(
        server.url + "/embed", content=b"no image", headers={**PNG, "X-Request-Id": "bad"}
    )
    assert bad.status_code == 400
    failed = httpx.post(
        server.url + "/embed", content=marked_png(7), headers={**PNG, "X-Request-Id": "failed"}
    )
    assert failed.status_code == 500
    until(lambda: collector.request("bad") and collector.request("failed"), 30, "both spans")
    bad_span, failed_span = collector.request("bad"), collector.request("failed")
    assert bad_span is not None and failed_span is not None

    assert bad_span.attributes["http.response.status_code"] == 400
    assert bad_span.status != ERROR_STATUS  # the client's error, not the server's
    assert failed_span.attributes["http.response.status_code"] == 500
    assert failed_span.status == ERROR_STATUS
    # No traceparent: a trace of their own, no parent.
    assert bad_span.parent == "" and failed_span.parent == ""
    assert bad_span.trace_id != failed_span.trace_id
    assert TRACE_ID not in (bad_span.trace_id, failed_span.trace_id)


def _imports_opentelemetry(endpoint: str) -> bool:
    """Whether building the app (which builds its tracing) imports OpenTelemetry."""
    code = (
        "import sys\n"
        "from clipserve.config import load_config\n"
        "from clipserve.http.app import create_app\n"
        f"create_app(load_config({{'otel_endpoint': {endpoint!r}}}, environ={{}}))\n"
        "print(any(m.split('.')[0] == 'opentelemetry' for m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip().splitlines()[-1] == "True"


@needs_otel
def test_tracing_off_imports_nothing() -> None:
    assert not _imports_opentelemetry("")
    assert _imports_opentelemetry("http://127.0.0.1:4318")  # the check can see an import


def test_otel_endpoint_without_the_packages_fails_in_one_line(tiny_config: Path) -> None:
    # OpenTelemetry blocked in the child, as if the extra were not installed.
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from clipserve.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    flags = ["--otel-endpoint", "http://127.0.0.1:4318", "--model", str(tiny_config)]
    out = subprocess.run(
        [sys.executable, "-c", code, *flags, "--backend", "fake", "--pretrained", "none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "clipserve: error: --otel-endpoint: needs OpenTelemetry: pip install 'clipserve[otel]'"
    ]


def test_otel_endpoint_must_be_a_url() -> None:
    with pytest.raises(ConfigError, match="--otel-endpoint: expected an http"):
        load_config({"otel_endpoint": "collector:4318"}, environ={})
    assert load_config({}, environ={}).http.otel_endpoint == ""  # off by default


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
@needs_otel
def test_each_front_end_exports_its_own_spans(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path, collector: Collector
) -> None:
    args = [
        *("--model", str(tiny_config), "--checkpoint", str(tiny_checkpoint)),
        *("--backend", "fake", "--workers", "2", "--otel-endpoint", collector.url),
    ]
    with contextlib.ExitStack() as stack:
        proc, url = stack.enter_context(cli_server(args, tmp_path / "server.log"))
        ids = [f"w{i}" for i in range(6)]
        for rid in ids:  # fresh connections: the kernel spreads them over the front ends
            headers = {**PNG, "X-Request-Id": rid}
            r = httpx.post(url + "/embed", content=marked_png(20), headers=headers, timeout=60)
            assert r.status_code == 200, r.text
        until(lambda: all(collector.request(rid) for rid in ids), 30, "every request's span")
        spans = [collector.request(rid) for rid in ids]
        children = {p.pid for p in psutil.Process(proc.pid).children()}
    for span in spans:
        assert span is not None
        assert span.pid in children  # exported by the front end that served it
        # The engine's queue and compute times arrive as the front end's stages.
        names = until(functools.partial(_names_if_all, collector, span), 30, "its stages")
        assert names >= STAGES


@pytest.mark.slow  # a multi-process variant: CI runs it (make test-slow)
@needs_otel
def test_a_front_end_exports_its_last_spans_as_it_stops(
    tiny_config: Path,
    tiny_checkpoint: Path,
    tmp_path: Path,
    collector: Collector,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A front end leaves by os._exit, which skips the SDK's exit-time flush: spans still in
    its batch (sent every 5 s, the SDK's default, here) would be lost; they are flushed on the
    way out."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "5000")
    args = [
        *("--model", str(tiny_config), "--checkpoint", str(tiny_checkpoint)),
        *("--backend", "fake", "--workers", "2", "--otel-endpoint", collector.url),
    ]
    with cli_server(args, tmp_path / "server.log") as (proc, url):
        headers = {**PNG, "X-Request-Id": "last-one"}
        r = httpx.post(url + "/embed", content=marked_png(20), headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)  # well inside the batch's 5 s
        assert proc.wait(30) == 0
    until(lambda: collector.request("last-one"), 10, "the last request's span")


def _names_if_all(collector: Collector, span: Span) -> set[str]:
    """The span's stage names once all have arrived (empty until then)."""
    names = {c.name for c in collector.children(span)}
    return names if names >= STAGES else set()


# ---- gRPC: Triton's service, the real tritonclient ----------------------------------------------


def _grpc(server: RunningServer) -> tg.InferenceServerClient:
    return tg.InferenceServerClient(f"127.0.0.1:{server.app.state.grpc_port}")


def _image(png: bytes, name: str = "image") -> tg.InferInput:
    inp = tg.InferInput(name, [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[png]], dtype=np.object_))
    return inp


def _exported(collector: Collector, request_id: str) -> Span:
    span = until(lambda: collector.request(request_id), 30, f"{request_id}'s span exported")
    assert span is not None
    return span


@needs_otel
def test_a_grpc_call_is_a_server_span_with_its_stages_inside(
    serve: Serve, collector: Collector
) -> None:
    server = serve(backend="fake", otel_endpoint=collector.url, grpc_port=free_port())
    with _grpc(server) as client:
        result = client.infer(
            model_name(server), [_image(marked_png(1))], headers={"x-request-id": "g-infer"}
        )
        assert result.as_numpy("embedding").shape[0] == 1
        assert client.is_server_live(headers={"x-request-id": "g-live"})
    span = _exported(collector, "g-infer")

    # gRPC's semantic attributes in place of HTTP's; clipserve's own as over HTTP.
    assert span.name == f"{GRPC_SERVICE}/ModelInfer"
    assert span.kind == SERVER_KIND
    assert span.attributes["rpc.system"] == "grpc"
    assert span.attributes["rpc.service"] == GRPC_SERVICE
    assert span.attributes["rpc.method"] == "ModelInfer"
    assert span.attributes["rpc.grpc.status_code"] == 0  # OK
    assert span.attributes["client.address"] == "127.0.0.1"
    assert isinstance(span.attributes["client.port"], int)
    assert span.attributes["clipserve.items"] == 1
    assert span.status != ERROR_STATUS
    assert span.parent == "" and span.trace_id != TRACE_ID  # no traceparent: its own trace

    # One child per stage the call timed, end to end inside the call's span.
    names = until(functools.partial(_names_if_all, collector, span), 30, "its stages")
    assert names >= STAGES
    children = collector.children(span)
    for child in children:
        assert child.trace_id == span.trace_id
        assert span.start_ns <= child.start_ns <= child.end_ns <= span.end_ns, child.name
    assert sum(c.end_ns - c.start_ns for c in children) <= span.end_ns - span.start_ns

    # A probe is a span too, as HTTP's are; it times no stages.
    live = _exported(collector, "g-live")
    assert live.name == f"{GRPC_SERVICE}/ServerLive"
    assert live.attributes["rpc.grpc.status_code"] == 0
    assert "clipserve.items" not in live.attributes
    assert collector.children(live) == []


@needs_otel
def test_a_grpc_call_continues_the_trace_in_its_metadata(
    serve: Serve, collector: Collector
) -> None:
    server = serve(backend="fake", otel_endpoint=collector.url, grpc_port=free_port())
    metadata = {
        "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01",
        "tracestate": "vendor=opaque",
        "x-request-id": "g-traced",
    }
    with _grpc(server) as client:
        client.infer(model_name(server), [_image(marked_png(2))], headers=metadata)
    span = _exported(collector, "g-traced")
    assert (span.trace_id, span.parent) == (TRACE_ID, CALLER_SPAN)
    assert span.trace_state == "vendor=opaque"
    names = until(functools.partial(_names_if_all, collector, span), 30, "its stages")
    assert names >= STAGES
    assert all(c.trace_id == TRACE_ID for c in collector.children(span))


@needs_otel
def test_a_failed_grpc_call_records_its_status(serve: Serve, collector: Collector) -> None:
    server = serve(
        backend="fake",
        backend_option=["fail_pixel=7"],
        otel_endpoint=collector.url,
        grpc_port=free_port(),
    )
    bad = tg.InferInput("pixels", [1, 7, 7, 3], "UINT8")  # the model takes 224 by 224
    bad.set_data_from_numpy(np.zeros((1, 7, 7, 3), np.uint8))
    with _grpc(server) as client:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(model_name(server), [bad], headers={"x-request-id": "g-bad"})
        assert str(refused.value.status()) == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as failed:
            client.infer(
                model_name(server), [_image(marked_png(7))], headers={"x-request-id": "g-failed"}
            )
        assert str(failed.value.status()) == "StatusCode.INTERNAL"
    bad_span, failed_span = _exported(collector, "g-bad"), _exported(collector, "g-failed")

    assert bad_span.attributes["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT
    assert bad_span.status != ERROR_STATUS  # the client's error, not the server's
    assert "clipserve.items" not in bad_span.attributes  # none parsed
    assert failed_span.attributes["clipserve.items"] == 1
    assert failed_span.attributes["rpc.grpc.status_code"] == 13  # INTERNAL
    assert failed_span.status == ERROR_STATUS
    # The stages the failed call ran are there too.
    until(lambda: {c.name for c in collector.children(failed_span)} >= {"decode", "queue"}, 30)
