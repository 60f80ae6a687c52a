"""The gRPC service's method table (`grpc_server.Methods`): a handler registers under Triton's
method of its own name, with that method's message types, or the server fails to build; and
every method takes its message as bytes, parsed inside the call's guard (a real grpc.aio
server on loopback for that)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb

from clipserve.http.doors.kserve_grpc import InferenceServicer
from clipserve.http.grpc_server import SERVICE, CallGuard, Context, Methods
from clipserve.http.pipeline import Pipeline
from clipserve.loadgen.procs import free_port
from clipserve.metrics import Metrics
from tests.helpers import RunningServer, Serve, access_lines, make_config, running, until

LiveContext = Context[pb.ServerLiveRequest, pb.ServerLiveResponse]


class Handlers:
    """Handlers as a servicer has them, some of them wrong."""

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: LiveContext, rid: str
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerIsLive(
        self, request: pb.ServerLiveRequest, context: LiveContext, rid: str
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ModelInfer(self, body: bytes, context: Context[bytes, bytes], rid: str) -> bytes:
        return body

    async def ModelStreamInfer(
        self, body: bytes, context: Context[bytes, bytes], rid: str
    ) -> bytes:
        return body


def _methods() -> Methods:
    return Methods(CallGuard(Metrics(), None))


def test_each_method_registers_under_its_name_with_its_messages() -> None:
    methods, handlers = _methods(), Handlers()
    methods.unary(handlers.ServerLive, pb.ServerLiveRequest, pb.ServerLiveResponse)
    methods.raw(handlers.ModelInfer)
    assert set(methods.handlers) == {"ServerLive", "ModelInfer"}
    live = methods.handlers["ServerLive"]
    assert not live.request_streaming and not live.response_streaming
    # Bytes in (parsed inside the guard: see the tests below), the message out.
    assert live.request_deserializer is None and live.response_serializer is not None
    answer = pb.ServerLiveResponse(live=True)
    assert live.response_serializer(answer) == answer.SerializeToString()
    infer = methods.handlers["ModelInfer"]  # bytes through: parsed after admission
    assert infer.request_deserializer is None and infer.response_serializer is None
    assert isinstance(infer, grpc.RpcMethodHandler)


def test_a_name_not_in_the_service_fails_to_register() -> None:
    with pytest.raises(TypeError, match="has no unary method 'ServerIsLive'"):
        _methods().unary(Handlers().ServerIsLive, pb.ServerLiveRequest, pb.ServerLiveResponse)


def test_other_message_types_fail_to_register() -> None:
    with pytest.raises(TypeError, match=r"ServerLive takes inference\.ServerLiveRequest"):
        _methods().unary(
            Handlers().ServerLive,  # type: ignore[arg-type]
            pb.ServerReadyRequest,
            pb.ServerLiveResponse,
        )


def test_a_streaming_method_fails_to_register() -> None:
    with pytest.raises(TypeError, match="has no unary method 'ModelStreamInfer'"):
        _methods().raw(Handlers().ModelStreamInfer)


def _served() -> list[str]:
    """The methods the server registers, read off the servicer itself: a method added there is
    covered here without a change."""
    methods = _methods()
    # register() only reads the servicer's bound methods; no call reaches the pipeline here.
    InferenceServicer(cast(Pipeline[Any], None)).register(methods)
    return sorted(methods.handlers)


SERVED = _served()
TRITON = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]


@pytest.fixture(scope="module")
def server(tiny_config: Any, tiny_checkpoint: Any) -> Iterator[RunningServer]:
    config = make_config(tiny_config, tiny_checkpoint, backend="fake", grpc_port=free_port())
    with running(config) as s:
        yield s


def _fields(records: list[logging.LogRecord], request_id: str) -> list[dict[str, Any]]:
    """The access lines' fields for one request."""
    fields = (getattr(r, "fields", {}) for r in records)
    return [f for f in fields if f.get("request_id") == request_id]


def _requests_total(server: RunningServer, route: str, status: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    labels = re.escape(f'route="{route}",status="{status}"')
    found = re.search(rf"^clipserve_requests_total\{{{labels}\}} (\S+)$", text, re.M)
    return 0.0 if found is None else float(found.group(1))


def _call(
    server: RunningServer, route: str, body: bytes, metadata: tuple[tuple[str, str], ...]
) -> grpc.RpcError:
    target = f"127.0.0.1:{server.app.state.grpc_port}"
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as e:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(route)
        call(body, metadata=metadata, timeout=30)
    return e.value


def _trailing(error: grpc.RpcError) -> dict[str, str | bytes]:
    return {item.key: item.value for item in error.trailing_metadata() or ()}


@pytest.mark.parametrize("method", SERVED)
@pytest.mark.parametrize("body", [b"\xff\xff", b"\x0a\xff"], ids=["bad-tag", "short-field"])
def test_a_malformed_message_is_invalid_argument_counted_and_logged(
    server: RunningServer, method: str, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused inside the guard, as ModelInfer's are: INVALID_ARGUMENT naming the message type
    (no exception class), a 400 in the metrics and the access log, and no ERROR line."""
    route = f"/{SERVICE}/{method}"
    message_type = TRITON.methods_by_name[method].input_type.name
    request_id = f"malformed-{method}-{body.hex()}"
    before = _requests_total(server, route, "400")
    with caplog.at_level(logging.WARNING), access_lines() as lines:
        error = _call(server, route, body, (("x-request-id", request_id),))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        details = error.details() or ""
        assert details.startswith(f"malformed {message_type}"), details
        assert "Error" not in details and "<class" not in details
        assert _trailing(error)["x-request-id"] == request_id
        # The guard counts and logs the call as the status leaves: a moment after the client
        # has it.
        mine = until(lambda: _fields(lines, request_id), 5)
    assert [(f["route"], f["status"]) for f in mine] == [(route, 400)]
    assert _requests_total(server, route, "400") == before + 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def test_keys_are_checked_before_a_malformed_message_is_parsed(
    serve: Serve, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("alice:sk-alice-0123456789\n")
    server = serve(grpc_port=free_port(), backend="fake", api_keys=str(keys))
    route = f"/{SERVICE}/ModelMetadata"
    error = _call(server, route, b"\xff\xff", ())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
    with access_lines() as lines:
        key = (("x-api-key", "sk-alice-0123456789"), ("x-request-id", "keyed-malformed"))
        error = _call(server, route, b"\xff\xff", key)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        mine = until(lambda: _fields(lines, "keyed-malformed"), 5)
    assert [(f["status"], f["key"]) for f in mine] == [(400, "alice")]
    assert _requests_total(server, route, "401") == 1
    # A repeated key is read as HTTP reads a repeated header: the first one counts.
    first_valid = (("x-api-key", "sk-alice-0123456789"), ("x-api-key", "sk-wrong-000000000"))
    assert _call(server, route, b"\xff\xff", first_valid).code() == grpc.StatusCode.INVALID_ARGUMENT
    first_wrong = tuple(reversed(first_valid))
    assert _call(server, route, b"\xff\xff", first_wrong).code() == grpc.StatusCode.UNAUTHENTICATED
