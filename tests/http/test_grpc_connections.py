"""The gRPC door's connections and calls under load: idle connections closed after
--grpc-max-connection-idle-s, old ones after --grpc-max-connection-age-s, and calls past
--max-connections answered by the door itself (UNAVAILABLE, counted and logged as a 503). A
real grpc.aio server on loopback in this process, real grpc channels; the server's sockets
are read off this process's own TCP table."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
import psutil
import pytest
from tritonclient.grpc import service_pb2 as pb

from clipserve.backends.fake import FakeExecutor
from clipserve.http.grpc_server import SERVICE, server_options
from tests.helpers import (
    RunningServer,
    Serve,
    access_lines,
    free_port,
    make_config,
    metric,
    model_name,
    png_bytes,
    random_pixels,
    until,
)

LIVE = f"/{SERVICE}/ServerLive"
INFER = f"/{SERVICE}/ModelInfer"


def _grpc_port(server: RunningServer) -> int:
    port = server.app.state.grpc_port
    assert port, "the server has no gRPC port"
    return int(port)


def _server_sockets(port: int) -> int:
    """Connections the server holds on its gRPC port (this process is client and server: the
    server's side is the one whose local port is the service's)."""
    return sum(
        1
        for c in psutil.Process().net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def _client_ports(port: int) -> set[int]:
    """The local ports of this process's connections to the gRPC port (the client's side)."""
    return {
        c.laddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def _live(channel: grpc.Channel) -> pb.ServerLiveResponse:
    call = channel.unary_unary(LIVE)
    return pb.ServerLiveResponse.FromString(call(pb.ServerLiveRequest().SerializeToString()))


def test_an_idle_connection_is_closed_by_the_server(serve: Serve) -> None:
    server = serve(grpc_port=free_port(), backend="fake", grpc_max_connection_idle_s=0.5)
    port = _grpc_port(server)
    # Each channel its own connection (a shared subchannel pool would give them one).
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(5)]
    try:
        for channel in channels:
            assert _live(channel).live
        assert _server_sockets(port) == 5
        until(lambda: _server_sockets(port) == 0, 10, "the server closing its idle connections")
        # The channels knew: they reconnect for the next call.
        assert all(_live(channel).live for channel in channels)
    finally:
        for channel in channels:
            channel.close()


@pytest.mark.slow  # ~3 s of calls across a reconnect; CI runs it (make test-slow)
def test_an_old_connection_is_replaced_without_failing_a_call(serve: Serve) -> None:
    server = serve(
        grpc_port=free_port(),
        backend="fake",
        grpc_max_connection_idle_s=0,
        grpc_max_connection_age_s=0.5,
    )
    port = _grpc_port(server)
    seen: set[int] = set()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # a busy channel: never idle
            assert _live(channel).live
            seen |= _client_ports(port)
            time.sleep(0.05)
    assert len(seen) >= 2, seen  # at least one new connection: the old one was closed


def test_the_age_grace_is_the_request_timeout(tiny_config: Any, tiny_checkpoint: Any) -> None:
    aged = make_config(
        tiny_config, tiny_checkpoint, grpc_max_connection_age_s=60, request_timeout_s=12.5
    )
    options = dict(server_options(aged, reuse_port=False))
    assert options["grpc.max_connection_age_ms"] == 60_000
    assert options["grpc.max_connection_age_grace_ms"] == 12_500
    assert options["grpc.max_connection_idle_ms"] == 300_000  # the default
    never = make_config(tiny_config, tiny_checkpoint, grpc_max_connection_idle_s=0)
    assert not {"grpc.max_connection_idle_ms", "grpc.max_connection_age_ms"} & set(
        dict(server_options(never, reuse_port=False))
    )


@pytest.mark.slow  # ~9 s: two 3 s batches held; CI runs it (make test-slow)
def test_calls_past_max_connections_are_the_doors_overload(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """Two calls on a device of 3 s a batch hold --max-connections 2: three more are
    UNAVAILABLE with the retry hint and their request ids, 503s in the metrics and the access
    log; a probe is still answered; then the limit is free again."""
    server = serve(grpc_port=free_port(), backend="fake", max_batch_size=1, max_connections=2)
    executor = server.state.runtime.executors[0]
    assert isinstance(executor, FakeExecutor)
    executor.latency_s = 3.0  # from now on: the warm-up ran at full speed
    request = pb.ModelInferRequest(model_name=model_name(server))
    inp = request.inputs.add(name="image", datatype="BYTES", shape=[1])
    inp.contents.bytes_contents.append(png_bytes(random_pixels(1)))
    body = request.SerializeToString()
    with (
        caplog.at_level(logging.WARNING),
        access_lines() as lines,
        grpc.insecure_channel(f"127.0.0.1:{_grpc_port(server)}") as channel,
    ):
        infer = channel.unary_unary(INFER)
        calls = [
            infer.future(body, metadata=(("x-request-id", f"over-{i}"),), timeout=30)
            for i in range(5)
        ]
        until(lambda: sum(c.done() for c in calls) >= 3, 2.8, "three calls refused at once")
        assert _live(channel).live  # probes are never refused
        answers: list[Any] = []
        for c in calls:
            try:
                answers.append(pb.ModelInferResponse.FromString(c.result()))
            except grpc.RpcError as e:
                answers.append(e)
        served = [a for a in answers if isinstance(a, pb.ModelInferResponse)]
        refused = [a for a in answers if isinstance(a, grpc.RpcError)]
        assert len(served) == 2 and len(refused) == 3, answers
        ids = set()
        for error in refused:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert error.details() == "2 calls running, the limit (--max-connections)"
            trailing = dict(error.trailing_metadata() or ())
            assert trailing["retry-pushback-ms"] == "1000"
            ids.add(trailing["x-request-id"])
        assert ids < {f"over-{i}" for i in range(5)}
        refusals = until(lambda: [r for r in lines if r.fields.get("status") == 503], 5)
        assert {r.fields["request_id"] for r in refusals} == ids
        assert {r.fields["route"] for r in refusals} == {INFER}
        # The limit is given back as calls end: one more is served.
        assert pb.ModelInferResponse.FromString(infer(body, timeout=30)).outputs
    assert metric(server, f'clipserve_requests_total{{route="{INFER}",status="503"}}') == 3
    assert metric(server, f'clipserve_requests_total{{route="{INFER}",status="200"}}') == 3
    warnings = [r.getMessage() for r in caplog.records if "refusing gRPC calls" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per 10 s, however many are refused
