"""The gRPC service's method table (`grpc_server.Methods`): a handler registers under Triton's
method of its own name, with that method's message types, or the server fails to build."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from clipserve.http.grpc_server import CallGuard, Context, Methods
from clipserve.metrics import Metrics

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
    assert live.request_deserializer is not None and live.response_serializer is not None
    assert live.request_deserializer(b"") == pb.ServerLiveRequest()
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
