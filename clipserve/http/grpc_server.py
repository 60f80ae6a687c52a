"""Triton's gRPC service (`inference.GRPCInferenceService`: KServe v2 and Triton's additions)
on grpc.aio, in each front-end process beside uvicorn and on the same event loop, so a gRPC
inference walks the same pipeline as an HTTP one (http/doors/kserve_grpc.py).

Around every call, what the HTTP side does in its middleware: a request id (`x-request-id`
metadata, echoed in the trailing metadata: initial metadata sent on its own costs a write per
call, ~6% of a call's CPU), the key check and the rate limit's first token
(`authorization: Bearer` or `x-api-key` metadata), the count and duration by method and by
the HTTP status the same error would have (so dashboards and alerts read one series), the
access line, the call's span where --otel-endpoint is on (http/tracing.py: its parent the
`traceparent` metadata, ModelInfer's stages its children), and each domain error as a gRPC
status (`grpc_status.py`). The guard also holds calls running to --max-connections: one more is
the door's overload, UNAVAILABLE with `retry-pushback-ms`, counted and logged as a 503, as an
HTTP connection over it is.

Every method is registered without grpc's deserializer, which would run before the guard: a
message that does not parse would then be UNKNOWN with the exception's class in its text, a
traceback in the log, and no count or access line. ModelInfer's bytes go to the pipeline
(`Methods.raw`), which parses them in the decode pool after admission, as every HTTP body is;
the other methods' small messages are parsed inside the guard (`Methods.unary`), where a
broken one is InvalidBody (INVALID_ARGUMENT), as a broken ModelInferRequest is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2

from clipserve.config import ServerConfig
from clipserve.errors import ClipserveError, InvalidBody, Overloaded, StartupError, Unauthorized
from clipserve.http.access import Access
from clipserve.http.charges import charging
from clipserve.http.connections import CAP_LOG_INTERVAL_S, refusal_room
from clipserve.http.grpc_status import grpc_error
from clipserve.http.keys import Grant
from clipserve.http.listeners import check_tls
from clipserve.http.observer import new_request_id, request_tracing, valid_request_id
from clipserve.http.status import CLIENT_CLOSED, status_for
from clipserve.logs import ACCESS, log_access
from clipserve.metrics import Metrics

if TYPE_CHECKING:
    from clipserve.http.tracing import RequestSpan, RequestTracing

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
# Probes hold no key and are never refused at --max-connections: a liveness probe refused
# under load would have a busy pod restarted.
OPEN_METHODS = frozenset({"ServerLive", "ServerReady", "ModelReady"})
MAX_CONCURRENT_STREAMS = 128  # per HTTP/2 connection; --max-connections bounds all calls
GRPC_INT_MAX = 2**31 - 1  # grpc's integer channel arguments are C ints
_SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]

Req = TypeVar("Req")
Resp = TypeVar("Resp")
ReqM = TypeVar("ReqM", bound=Message)
RespM = TypeVar("RespM", bound=Message)

Context: TypeAlias = grpc.aio.ServicerContext[Req, Resp]  # a call's, as grpc.aio passes it
# A servicer's method: the request, its call's context, the request id (CallGuard's).
Handler: TypeAlias = Callable[[Req, Context[Req, Resp], str], Awaitable[Resp]]
# What grpc.aio calls: a handler wrapped by CallGuard.
Behaviour: TypeAlias = Callable[[Req, Context[Req, Resp]], Awaitable[Resp]]
# The running call's span, set only while tracing is on. grpc.aio runs each call in a task of
# its own, so the value is the call's alone and goes with its task.
_CALL_SPAN: ContextVar[RequestSpan | None] = ContextVar("clipserve_call_span", default=None)


def call_span() -> RequestSpan | None:
    """The running call's span, for the handler to hand its exchange (stages, items)."""
    return _CALL_SPAN.get()


def _metadata(sent: grpc.aio.Metadata | None) -> dict[str, str | bytes]:
    """A call's metadata by key; of repeated keys the first, as HTTP's headers are read."""
    found: dict[str, str | bytes] = {}
    for key, value in sent or ():
        found.setdefault(key, value)
    return found


def _request_id(metadata: dict[str, str | bytes]) -> str:
    sent = metadata.get("x-request-id")
    if isinstance(sent, str) and sent.isascii() and valid_request_id(sent.encode()):
        return sent
    return new_request_id()


class CallGuard:
    """What wraps every RPC: see the module's notes."""

    def __init__(
        self,
        metrics: Metrics,
        access: Access | None,
        max_calls: int | None = None,
        tracing: RequestTracing | None = None,
    ) -> None:
        self.metrics = metrics
        self.access = access
        self.max_calls = max_calls  # --max-connections; None: no limit of ours
        self.tracing = tracing  # --otel-endpoint's; None: off, one test a call
        self.running = 0  # calls held to max_calls and not yet answered
        self._warned, self._suppressed = -math.inf, 0

    def wrap(self, method: str, handler: Handler[Req, Resp]) -> Behaviour[Req, Resp]:
        route = f"/{SERVICE}/{method}"
        guarded = method not in OPEN_METHODS
        limit = self.max_calls if guarded else None
        tracing = self.tracing

        async def call(request: Req, context: Context[Req, Resp]) -> Resp:
            t0 = time.perf_counter()
            metadata = _metadata(context.invocation_metadata())
            request_id = _request_id(metadata)
            status, key, held = 200, None, False
            span = None if tracing is None else _started(tracing, method, metadata, context)
            context.set_trailing_metadata((("x-request-id", request_id),))  # sent with the status
            try:
                if limit is not None:
                    if self.running >= limit:
                        raise self._refused()
                    self.running += 1
                    held = True
                if guarded and self.access is not None:
                    grant = self._grant(metadata)
                    key = grant.label
                    if method == "ModelInfer" and grant.rate is not None:
                        wait = self.access.wait_s(grant)
                        if wait > 0:  # refused before the message is parsed
                            raise self.access.refused(grant, grant.rate, wait)
                    with charging(grant):
                        return await handler(request, context, request_id)
                return await handler(request, context, request_id)
            except asyncio.CancelledError:
                status = CLIENT_CLOSED  # the client cancelled or its deadline passed
                raise
            except grpc.aio.AbortError:
                status = 400  # the handler aborted with a status of its own
                raise
            except Exception as exc:
                if isinstance(exc, ClipserveError):
                    status = status_for(exc)
                else:
                    status = 500
                    log.error("unhandled error, request id %s", request_id, exc_info=exc)
                error = grpc_error(exc)
                trailing = (*error.trailing_metadata, ("x-request-id", request_id))
                await context.abort(error.code, error.message, trailing)
            finally:
                if held:
                    self.running -= 1
                elapsed = time.perf_counter() - t0
                self.metrics.requests.labels(route, str(status)).inc()
                self.metrics.request_duration.labels(route).observe(elapsed)
                if ACCESS.isEnabledFor(logging.INFO):
                    peer = context.peer()
                    log_access(request_id, "GRPC", route, route, status, elapsed, None, peer, key)
                if span is not None:
                    span.finish_call(_answered(context, status), request_id, key)

        return call

    def _refused(self) -> Overloaded:
        """The overload a call past --max-connections gets; a warning at most every 10 s, as
        HTTP's refused connections have (a flood of refusals must not flood the log)."""
        now = time.monotonic()
        if now - self._warned >= CAP_LOG_INTERVAL_S:
            log.warning(
                "refusing gRPC calls: %d running, the --max-connections limit (%d more refused "
                "since the last such message)",
                self.running,
                self._suppressed,
            )
            self._warned, self._suppressed = now, 0
        else:
            self._suppressed += 1
        return Overloaded(f"{self.running} calls running, the limit (--max-connections)")

    def _grant(self, metadata: dict[str, str | bytes]) -> Grant:
        assert self.access is not None
        pairs = [
            (name.encode(), value.encode() if isinstance(value, str) else value)
            for name, value in metadata.items()
            if name in ("authorization", "x-api-key")
        ]
        grant = self.access.grant_for(pairs)
        if grant is None:
            raise Unauthorized(
                "the API key is not valid"
                if pairs
                else "an API key is required: authorization: Bearer <key>, or x-api-key: <key>"
            )
        return grant


def _started(
    tracing: RequestTracing,
    method: str,
    metadata: dict[str, str | bytes],
    context: Context[Any, Any],
) -> RequestSpan:
    span = tracing.start_call(SERVICE, method, metadata, context.peer())
    _CALL_SPAN.set(span)
    return span


def _answered(context: Context[Any, Any], status: int) -> grpc.StatusCode:
    """The code the call ended with: the one aborted with, else OK or, cut off, the client's."""
    code = context.code()
    if code is not None:
        return code
    if status != CLIENT_CLOSED:
        return grpc.StatusCode.OK
    remaining = context.time_remaining()
    cancelled = remaining is None or remaining > 0
    return grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.DEADLINE_EXCEEDED


class Methods:
    """The servicer's handlers, each wrapped by the guard and checked against Triton's service
    descriptor: a misspelt name or other message types would register a method no client can
    call, so they fail at startup instead."""

    def __init__(self, guard: CallGuard) -> None:
        self.guard = guard
        # grpc's own type for a service's table: its methods take and give different types.
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def unary(
        self, handler: Handler[ReqM, RespM], request: type[ReqM], response: type[RespM]
    ) -> None:
        """The method named as `handler` is: it gets the parsed request and returns the
        response message."""
        name = handler.__name__
        self._check(name, request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name)
        self.handlers[name] = grpc.unary_unary_rpc_method_handler(
            self.guard.wrap(name, _parsing(handler, request)),
            response_serializer=response.SerializeToString,
        )

    def raw(self, handler: Handler[bytes, bytes]) -> None:
        """The method named as `handler` is, taking and returning serialized messages (the
        pipeline parses ModelInfer in the decode pool, after admission)."""
        name = handler.__name__
        self._check(name)
        self.handlers[name] = grpc.unary_unary_rpc_method_handler(self.guard.wrap(name, handler))

    def _check(self, name: str, request: str | None = None, response: str | None = None) -> None:
        method = _SERVICE.methods_by_name.get(name)
        if method is None or method.client_streaming or method.server_streaming:
            raise TypeError(f"{SERVICE} has no unary method {name!r}")
        types = (method.input_type.full_name, method.output_type.full_name)
        if request is not None and (request, response) != types:
            raise TypeError(f"{name} takes {types[0]} and returns {types[1]}")


def _parsing(handler: Handler[ReqM, RespM], request: type[ReqM]) -> Handler[bytes, RespM]:
    """`handler` taking the serialized message, parsed where the guard sees its errors."""
    what = request.DESCRIPTOR.name

    async def parse(body: bytes, context: Context[bytes, RespM], request_id: str) -> RespM:
        try:
            message = request.FromString(body)
        except DecodeError:
            raise InvalidBody(f"malformed {what} (not a protobuf message)") from None
        # The context's request type is only what a streaming call's read() would give.
        return await handler(message, cast(Context[ReqM, RespM], context), request_id)

    return parse


class Servicer(Protocol):
    """What `build_grpc_server` serves: the door registers each method it implements."""

    def register(self, methods: Methods) -> None: ...


def _ms(seconds: float) -> int:
    return max(1, min(GRPC_INT_MAX, round(min(seconds, GRPC_INT_MAX) * 1000)))


def server_options(config: ServerConfig, reuse_port: bool) -> list[tuple[str, int]]:
    """grpc.aio's channel arguments for `config`."""
    http, limits = config.http, config.limits
    options: list[tuple[str, int]] = [
        # The body limit, enforced by gRPC itself (RESOURCE_EXHAUSTED) before a byte is ours.
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_send_message_length", -1),  # answers are a few embeddings
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]
    # HTTP's --max-connections does not see gRPC's connections: an idle one is closed
    # (GOAWAY, then the socket) after --grpc-max-connection-idle-s instead.
    if http.grpc_max_connection_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(http.grpc_max_connection_idle_s)))
    if http.grpc_max_connection_age_s > 0:
        # GOAWAY at that age (grpc adds +-10% jitter), then the calls in flight have their
        # own deadline's worth to finish before the connection is closed under them.
        options.append(("grpc.max_connection_age_ms", _ms(http.grpc_max_connection_age_s)))
        grace = _ms(limits.request_timeout_s)
        options.append(("grpc.max_connection_age_grace_ms", grace))
    return options


def build_grpc_server(
    config: ServerConfig,
    servicer: Servicer,
    metrics: Metrics,
    access: Access | None,
    *,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """The server with every method `servicer` registers (others answer UNIMPLEMENTED, as
    gRPC does), bound to --host:--grpc-port; and the port bound (for port 0 in tests).
    `reuse_port`: the front ends of --workers N bind the same port (the supervisor holds it)."""
    http = config.http
    # grpc's own limit is only the hard ceiling, above ours: the guard answers the calls past
    # --max-connections (UNAVAILABLE, counted, logged), and each such refusal holds a place in
    # grpc's count for the moment it runs, its message received (up to --max-body-bytes). The
    # ceiling bounds that memory, as HTTP's refusal room bounds sockets past the limit; a call
    # past it gets grpc's own RESOURCE_EXHAUSTED before its message is read.
    ceiling = http.max_connections + refusal_room(http.max_connections)
    server = grpc.aio.server(
        options=server_options(config, reuse_port), maximum_concurrent_rpcs=ceiling
    )
    tracing = request_tracing(http.otel_endpoint)  # HTTP's: one exporter per process
    methods = Methods(CallGuard(metrics, access, http.max_connections, tracing))
    servicer.register(methods)
    generic = grpc.method_handlers_generic_handler(SERVICE, methods.handlers)
    server.add_generic_rpc_handlers((generic,))
    address = f"{http.host}:{http.grpc_port}"
    if http.ssl_certfile is not None and http.ssl_keyfile is not None:
        check_tls(http)
        with open(http.ssl_certfile, "rb") as cert, open(http.ssl_keyfile, "rb") as key:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
    try:
        if http.ssl_certfile is not None and http.ssl_keyfile is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc's "Failed to bind to address ..."
        problem = f"--grpc-port {http.grpc_port}: cannot listen on {address} ({e})"
        raise StartupError(problem) from None
    return server, port
