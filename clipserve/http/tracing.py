"""OpenTelemetry traces (--otel-endpoint): a server span per request, a child span per stage.

Imported only when tracing is on (the `otel` extra: opentelemetry-sdk and the OTLP/HTTP
exporter). An HTTP request and a gRPC call (Triton's service) get the same shape of span, with
HTTP's or gRPC's semantic attributes: it follows the caller's W3C `traceparent` (a header, or
the call's metadata), and its children are the stages the request timed for Server-Timing
(receive, decode, cache, fetch, queue, compute, encode): the timer keeps each stage's total,
not when it ran, so the children are laid end to end in the order the stages first ran, from
the request's start, inside its span. Their lengths are exact; their positions are the stages'
order, not measured offsets. With --workers N each front end exports its own spans (the
engine's queue and compute times arrive as stage times).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote, urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import (
    PROCESS_PID,
    SERVICE_NAME,
    OTELResourceDetector,
    Resource,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Scope

from clipserve import __version__

if TYPE_CHECKING:
    import grpc

    from clipserve.http.timing import StageTimer

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, where the endpoint names none
MAX_PATH = 1024
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_TRACE_METADATA = ("traceparent", "tracestate")
# The codes that make a gRPC server span an error (OpenTelemetry's RPC conventions): the others
# are the client's faults, as a 4xx is over HTTP.
_GRPC_ERRORS = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)
Attributes = dict[str, str | int]


def traces_url(endpoint: str) -> str:
    """The collector's base URL (http://collector:4318) gets OTLP's traces path; a URL with a
    path is used as given."""
    return endpoint.rstrip("/") + TRACES_PATH if urlsplit(endpoint).path in ("", "/") else endpoint


class Recorded(Protocol):
    """What a gRPC call's exchange records for its span: the stages and the items."""

    @property
    def timer(self) -> StageTimer: ...

    @property
    def items(self) -> int: ...


class RequestTracing:
    """The tracer every request's spans come from, and the provider that exports them (its
    batches are flushed when the process exits)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("clipserve", __version__)

    @classmethod
    def otlp(cls, endpoint: str) -> RequestTracing:
        """Spans exported in batches to the OTLP/HTTP collector at `endpoint`, from the service
        "clipserve" unless the standard variables name another."""
        # The SDK's detection (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME) goes over ours, so
        # "clipserve" is only the default name; the sampler is the SDK's (OTEL_TRACES_SAMPLER).
        ours = Resource.create({SERVICE_NAME: "clipserve", PROCESS_PID: os.getpid()})
        resource = ours.merge(OTELResourceDetector().detect())
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(traces_url(endpoint))))
        return cls(provider)

    def start(self, scope: Scope) -> RequestSpan:
        """An HTTP request's span, started now; its parent is the caller's `traceparent`."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _TRACE_HEADERS
        }
        client = scope.get("client")
        attributes: Attributes = {
            "http.request.method": scope["method"],
            "url.path": scope["path"][:MAX_PATH],
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        if client:
            attributes.update({"client.address": client[0], "client.port": client[1]})
        return self._start(scope["method"], carrier, attributes)

    def start_call(
        self, service: str, method: str, metadata: Mapping[str, str | bytes], peer: str
    ) -> RequestSpan:
        """A gRPC call's span, started now, named as OpenTelemetry names RPCs; its parent is the
        `traceparent` in the call's metadata."""
        carrier = {
            name: value for name in _TRACE_METADATA if isinstance(value := metadata.get(name), str)
        }
        attributes: Attributes = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": method,
            **_client(peer),
        }
        return self._start(f"{service}/{method}", carrier, attributes)

    def _start(self, name: str, carrier: dict[str, str], attributes: Attributes) -> RequestSpan:
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        start_ns, t0 = time.time_ns(), time.perf_counter()
        span = self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes, start_time=start_ns
        )
        return RequestSpan(self, span, start_ns, t0)

    def close(self) -> None:
        self.provider.shutdown()


def _client(peer: str) -> Attributes:
    """grpc's peer ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000", percent-encoded by some versions)
    as HTTP's client attributes; a Unix socket's has neither."""
    kind, _, address = unquote(peer).partition(":")
    host, _, port = address.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return {}
    return {"client.address": host.strip("[]"), "client.port": int(port)}


class RequestSpan:
    """One request's span while it runs; `finish` (HTTP) or `finish_call` (gRPC) adds what the
    answer tells and the stages."""

    exchange: Recorded | None = None  # a gRPC call's, once its handler has made one

    def __init__(self, tracing: RequestTracing, span: Span, start_ns: int, t0: float) -> None:
        self.tracing = tracing
        self.span = span
        self.start_ns = start_ns  # the span's start on the wall clock
        self.t0 = t0  # and on the monotonic one, which times it

    def finish(self, scope: Scope, route: str, status: int) -> None:
        end_ns = self._end_ns()
        if route != "other":  # no route matched: the name is the method alone
            self.span.update_name(f"{scope['method']} {route}")
            self.span.set_attribute("http.route", route)
        self.span.set_attribute("http.response.status_code", status)
        state = scope.get("state", {})
        # A server span's 4xx are the client's errors, not the server's.
        error, request_id = status >= 500, state.get("request_id", "")
        self._end(
            end_ns, error, request_id, state.get("items"), state.get("key"), state.get("timer")
        )

    def finish_call(self, code: grpc.StatusCode, request_id: str, key: str | None) -> None:
        end_ns = self._end_ns()
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        error, exchange = code.name in _GRPC_ERRORS, self.exchange
        if exchange is None:  # not an inference, or one refused before it had an exchange
            self._end(end_ns, error, request_id, None, key, None)
        else:  # no items until the message is parsed: absent then, as over HTTP
            self._end(end_ns, error, request_id, exchange.items or None, key, exchange.timer)

    def _end_ns(self) -> int:
        return self.start_ns + int((time.perf_counter() - self.t0) * 1e9)

    def _end(
        self,
        end_ns: int,
        error: bool,
        request_id: str,
        items: int | None,
        key: str | None,
        timer: StageTimer | None,
    ) -> None:
        span = self.span
        span.set_attribute("clipserve.request_id", request_id)
        if items is not None:
            span.set_attribute("clipserve.items", items)
        if key is not None:
            span.set_attribute("clipserve.key", key)
        if error:
            span.set_status(Status(StatusCode.ERROR))
        if timer is not None:
            self._stages(timer.stages, set_span_in_context(span), end_ns)
        span.end(end_time=end_ns)

    def _stages(self, stages: dict[str, float], parent: Context, end_ns: int) -> None:
        """A child span per stage, end to end from the request's start, none past its end
        (a request for both towers runs their queue and compute at once)."""
        at = self.start_ns
        for name, seconds in stages.items():
            length = min(int(seconds * 1e9), end_ns - self.start_ns)
            begin = min(at, end_ns - length)
            child = self.tracing.tracer.start_span(name, context=parent, start_time=begin)
            child.end(end_time=begin + length)
            at = begin + length
