"""OpenTelemetry traces (--otel-endpoint): a server span per request, a child span per stage.

Imported only when tracing is on (the `otel` extra: opentelemetry-sdk and the OTLP/HTTP
exporter). The request's span follows the caller's W3C `traceparent`. Its children are the
stages the request timed for Server-Timing (receive, decode, cache, fetch, queue, compute,
encode): the timer keeps each stage's total, not when it ran, so the children are laid end to
end in the order the stages first ran, from the request's start, inside its span. Their lengths
are exact; their positions are the stages' order, not measured offsets. With --workers N each
front end exports its own spans (the engine's queue and compute times arrive as stage times).
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

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

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, where the endpoint names none
MAX_PATH = 1024
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = (b"traceparent", b"tracestate")


def traces_url(endpoint: str) -> str:
    """The collector's base URL (http://collector:4318) gets OTLP's traces path; a URL with a
    path is used as given."""
    return endpoint.rstrip("/") + TRACES_PATH if urlsplit(endpoint).path in ("", "/") else endpoint


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
        """The request's span, started now; its parent is the caller's `traceparent`, if any."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _TRACE_HEADERS
        }
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        client = scope.get("client")
        attributes: dict[str, str | int] = {
            "http.request.method": scope["method"],
            "url.path": scope["path"][:MAX_PATH],
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        if client:
            attributes.update({"client.address": client[0], "client.port": client[1]})
        start_ns, t0 = time.time_ns(), time.perf_counter()
        span = self.tracer.start_span(
            scope["method"],
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=start_ns,
        )
        return RequestSpan(self, span, start_ns, t0)

    def close(self) -> None:
        self.provider.shutdown()


class RequestSpan:
    """One request's span while it runs; `finish` adds what the answer tells and the stages."""

    def __init__(self, tracing: RequestTracing, span: Span, start_ns: int, t0: float) -> None:
        self.tracing = tracing
        self.span = span
        self.start_ns = start_ns  # the span's start on the wall clock
        self.t0 = t0  # and on the monotonic one, which times it

    def finish(self, scope: Scope, route: str, status: int) -> None:
        span = self.span
        end_ns = self.start_ns + int((time.perf_counter() - self.t0) * 1e9)
        if route != "other":  # no route matched: the name is the method alone
            span.update_name(f"{scope['method']} {route}")
            span.set_attribute("http.route", route)
        span.set_attribute("http.response.status_code", status)
        state = scope.get("state", {})
        span.set_attribute("clipserve.request_id", state.get("request_id", ""))
        for name in ("items", "key"):
            if state.get(name) is not None:
                span.set_attribute(f"clipserve.{name}", state[name])
        if status >= 500:  # a server span's 4xx are the client's errors, not the server's
            span.set_status(Status(StatusCode.ERROR))
        timer = state.get("timer")
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
