"""Triton's gRPC service end to end: the real `tritonclient.grpc` against a real grpc.aio server
beside real uvicorn, on the tiny open_clip model (the fake backend where a test needs a slow or
counted device); answers compared with the HTTP doors'."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from clipserve.backends.base import normalise_numpy
from clipserve.backends.fake import FakeExecutor
from tests.helpers import (
    RunningServer,
    Serve,
    embed_image,
    embed_text,
    free_port,
    model_name,
    png_bytes,
    random_pixels,
    self_signed_cert,
    until,
)


def grpc_client(server: RunningServer) -> tg.InferenceServerClient:
    port = server.app.state.grpc_port
    assert port, "the server has no gRPC port"
    return tg.InferenceServerClient(f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def server(tiny_config: Any, tiny_checkpoint: Any) -> Iterator[RunningServer]:
    from tests.helpers import make_config, running

    config = make_config(
        tiny_config, tiny_checkpoint, max_items_per_request=8, grpc_port=free_port()
    )
    with running(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[tg.InferenceServerClient]:
    c = grpc_client(server)
    yield c
    c.close()


def _bytes(elements: list[bytes], name: str = "image") -> tg.InferInput:
    inp = tg.InferInput(name, [len(elements), 1], "BYTES")
    inp.set_data_from_numpy(np.array(elements, dtype=np.object_).reshape(-1, 1))
    return inp


def _code(error: InferenceServerException) -> str:
    return str(error.status())


def test_health_metadata_and_index(server: RunningServer, client: tg.InferenceServerClient) -> None:
    name = model_name(server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(name) and client.is_model_ready(name + "-text", "1")
    with pytest.raises(InferenceServerException) as e:
        client.is_model_ready("resnet50")
    assert _code(e.value) == "StatusCode.NOT_FOUND"
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "clipserve" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata(name, as_json=True)
    assert model["name"] == name and model["versions"] == ["1"]
    assert {i["datatype"] for i in model["inputs"]} == {"BYTES", "UINT8", "FP32", "FP16"}
    index = client.get_model_repository_index(as_json=True)["models"]
    names = {m["name"]: m["state"] for m in index}
    assert names[name] == "READY" and names[name + "-text"] == "READY"


def test_bytes_images_equal_embed(server: RunningServer, client: tg.InferenceServerClient) -> None:
    images = [png_bytes(random_pixels(s)) for s in (10, 11, 12)]
    result = client.infer(model_name(server), [_bytes(images)], request_id="g-1")
    got = result.as_numpy("embedding")
    assert got.dtype == np.float32 and got.shape == (3, 32)
    for i, image in enumerate(images):
        np.testing.assert_allclose(got[i], embed_image(server, image), atol=1e-6)
    assert result.get_response().id == "g-1"


@pytest.mark.parametrize(
    ("datatype", "dtype"), [("UINT8", np.uint8), ("FP32", np.float32), ("FP16", np.float16)]
)
def test_tensors_equal_embed(
    server: RunningServer, client: tg.InferenceServerClient, datatype: str, dtype: Any
) -> None:
    pixels = np.stack([random_pixels(20), random_pixels(21)])
    if datatype == "UINT8":
        tensor = pixels
    else:
        tensor = normalise_numpy(pixels, server.state.runtime.model.preprocess).astype(dtype)
    inp = tg.InferInput("INPUT__0", list(tensor.shape), datatype)
    inp.set_data_from_numpy(tensor)
    outputs = [tg.InferRequestedOutput("embedding"), tg.InferRequestedOutput("embedding_fp16")]
    result = client.infer(model_name(server), [inp], outputs=outputs)
    got, half = result.as_numpy("embedding"), result.as_numpy("embedding_fp16")
    assert half.dtype == np.float16
    tolerance = 2e-3 if datatype == "FP16" else 1e-5
    for i in range(2):
        expected = embed_image(server, png_bytes(pixels[i]))
        np.testing.assert_allclose(got[i], expected, atol=tolerance)
        np.testing.assert_allclose(half[i], expected, atol=2e-3)


def test_text_model_equals_embed_text(
    server: RunningServer, client: tg.InferenceServerClient
) -> None:
    texts = ["a photo of a cat", "ein Hund"]
    inp = _bytes([t.encode() for t in texts], "text")
    got = client.infer(model_name(server) + "-text", [inp]).as_numpy("embedding")
    np.testing.assert_allclose(got, embed_text(server, texts), atol=1e-6)


def test_errors_map_to_grpc_status_codes(
    server: RunningServer, client: tg.InferenceServerClient
) -> None:
    name = model_name(server)
    cases: list[tuple[str, list[tg.InferInput], str, str]] = [
        ("resnet50", [_bytes([b"x"])], "NOT_FOUND", "unknown model"),
        (name, [_bytes([b"not an image"])], "INVALID_ARGUMENT", "image"),
        (name, [_bytes([png_bytes(random_pixels(1))] * 9)], "INVALID_ARGUMENT", "8"),
    ]
    bad = tg.InferInput("pixels", [1, 7, 7, 3], "UINT8")
    bad.set_data_from_numpy(np.zeros((1, 7, 7, 3), np.uint8))
    cases.append((name, [bad], "INVALID_ARGUMENT", "224"))
    for model, inputs, code, text in cases:
        with pytest.raises(InferenceServerException) as e:
            client.infer(model, inputs)
        assert _code(e.value) == f"StatusCode.{code}", (model, e.value)
        assert text in e.value.message(), e.value.message()
    # A good request still works after all that.
    image = png_bytes(random_pixels(3))
    got = client.infer(name, [_bytes([image])]).as_numpy("embedding")
    np.testing.assert_allclose(got[0], embed_image(server, image), atol=1e-6)


def test_request_id_timing_and_metrics(
    server: RunningServer, client: tg.InferenceServerClient
) -> None:
    before = httpx.get(server.url + "/metrics").text
    client.infer(
        model_name(server),
        [_bytes([png_bytes(random_pixels(4))])],
        headers={"x-request-id": "grpc-id-7"},
    )
    text = httpx.get(server.url + "/metrics").text
    route = 'route="/inference.GRPCInferenceService/ModelInfer",status="200"'
    count = re.search(rf"^clipserve_requests_total\{{{re.escape(route)}\}} (\S+)$", text, re.M)
    assert count is not None and float(count.group(1)) >= 1
    assert 'clipserve_stage_duration_seconds_count{protocol="grpc-bytes",stage="compute"}' in text
    assert before != text
    # The request id and the stages come back in the trailing metadata, as HTTP's headers.
    request = pb.ModelInferRequest(model_name=model_name(server))
    inp = request.inputs.add(name="image", datatype="BYTES", shape=[1])
    inp.contents.bytes_contents.append(png_bytes(random_pixels(5)))
    with grpc.insecure_channel(f"127.0.0.1:{server.app.state.grpc_port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        metadata = (("x-request-id", "grpc-id-8"),)
        _, call = infer.with_call(request.SerializeToString(), metadata=metadata, timeout=30)
        trailing = dict(call.trailing_metadata())
        assert trailing["x-request-id"] == "grpc-id-8"
        assert {"decode", "queue", "compute"} <= {
            part.split(";")[0].strip() for part in trailing["server-timing"].split(",")
        }
        with pytest.raises(grpc.RpcError) as e:
            infer(b"\x0a\x03zzz", metadata=(("x-request-id", "bad id"),), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(dict(e.value.trailing_metadata())["x-request-id"]) > 8  # a new one: invalid


def test_message_over_max_body_bytes_is_resource_exhausted(serve: Serve) -> None:
    server = serve(grpc_port=free_port(), max_body_bytes=100_000)
    with grpc_client(server) as client:
        with pytest.raises(InferenceServerException) as e:
            client.infer(model_name(server), [_bytes([b"x" * 200_000])])
        assert _code(e.value) == "StatusCode.RESOURCE_EXHAUSTED"
        assert client.is_server_live()


def one_at_a_time(serve: Serve) -> RunningServer:
    """A device of 1.5 s a batch, one image a batch: a second request waits in the queue."""
    return serve(
        grpc_port=free_port(),
        backend="fake",
        backend_option=["latency_ms=1500"],
        max_batch_size=1,
        max_queue_delay_ms=1,
    )


@pytest.mark.slow  # ~18 s of held batches
def test_the_grpc_deadline_is_the_requests_deadline(serve: Serve) -> None:
    """A client deadline the busy device cannot meet is refused at once (as HTTP's
    X-Request-Timeout-Ms is), and the request never reaches the device."""
    server = one_at_a_time(serve)
    name = model_name(server)
    images = [png_bytes(random_pixels(i)) for i in range(3)]
    executor = server.state.runtime.executors[0]
    assert isinstance(executor, FakeExecutor)
    with grpc_client(server) as client:
        first = threading.Thread(target=client.infer, args=(name, [_bytes(images[:1])]))
        first.start()
        try:
            until(lambda: executor.attempts, 10, "the first batch on the device")
            t0 = time.perf_counter()
            with pytest.raises(InferenceServerException) as e:
                client.infer(name, [_bytes(images[1:2])], client_timeout=0.5)
            assert time.perf_counter() - t0 < 0.5
            assert _code(e.value) == "StatusCode.UNAVAILABLE"
            assert "past this request's deadline" in e.value.message()
            # Without a deadline of its own the same request waits and is served.
            client.infer(name, [_bytes(images[2:3])])
        finally:
            first.join(30)
        assert len(executor.attempts) == 2


def test_overload_is_unavailable_with_a_retry_hint(serve: Serve) -> None:
    server = serve(
        grpc_port=free_port(),
        backend="fake",
        backend_option=["latency_ms=1000"],
        max_batch_size=1,
        max_queue_size=1,
        max_items_per_request=1,
        max_queue_delay_ms=1,
    )
    request = pb.ModelInferRequest(model_name=model_name(server))
    inp = request.inputs.add(name="image", datatype="BYTES", shape=[1])
    inp.contents.bytes_contents.append(png_bytes(random_pixels(1)))
    body = request.SerializeToString()
    answers: list[Any] = []
    with grpc.insecure_channel(f"127.0.0.1:{server.app.state.grpc_port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

        def one() -> None:
            try:
                answers.append(pb.ModelInferResponse.FromString(call(body, timeout=30)))
            except grpc.RpcError as e:
                answers.append(e)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    refused = [a for a in answers if isinstance(a, grpc.RpcError)]
    served = [a for a in answers if isinstance(a, pb.ModelInferResponse)]
    assert refused and served and len(answers) == 6
    for error in refused:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        pushback = dict(error.trailing_metadata() or ())["retry-pushback-ms"]
        assert int(pushback) >= 1000
    assert served[0].outputs[0].shape == [1, 32]


@pytest.mark.slow  # ~18 s of held batches
def test_a_cancelled_call_never_reaches_the_device(serve: Serve) -> None:
    server = one_at_a_time(serve)
    name = model_name(server)
    executor = server.state.runtime.executors[0]
    assert isinstance(executor, FakeExecutor)
    with grpc_client(server) as client:
        first = threading.Thread(
            target=client.infer, args=(name, [_bytes([png_bytes(random_pixels(1))])])
        )
        first.start()
        try:
            until(lambda: executor.attempts, 10, "the first batch on the device")
            queued = client.async_infer(
                name, [_bytes([png_bytes(random_pixels(2))])], lambda result, error: None
            )
            until(lambda: server.state.towers["image"].depth() >= 1, 5, "the second queued")
            queued.cancel()
            # Gone from the queue while the first batch still runs: cancelled, not computed.
            until(lambda: server.state.towers["image"].depth() == 0, 1.2, "the item gone")
            assert first.is_alive()
        finally:
            first.join(30)
        time.sleep(0.5)
        assert len(executor.attempts) == 1  # the first only
        assert server.state.towers["image"].depth() == 0
        client.infer(name, [_bytes([png_bytes(random_pixels(3))])])
        assert len(executor.attempts) == 2


def test_api_keys_and_rate_limits_hold_over_grpc(serve: Serve, tmp_path: Any) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("alice:sk-alice-0123456789\nbob:sk-bob-0123456789:1:1\n")
    server = serve(grpc_port=free_port(), api_keys=str(keys))
    name = model_name(server)
    image = [_bytes([png_bytes(random_pixels(1))])]
    with grpc_client(server) as client:
        assert client.is_server_live()  # probes hold no key, as over HTTP
        for headers in ({}, {"authorization": "Bearer sk-wrong-0123456789"}):
            with pytest.raises(InferenceServerException) as e:
                client.infer(name, image, headers=headers)
            assert _code(e.value) == "StatusCode.UNAUTHENTICATED"
        got = client.infer(name, image, headers={"authorization": "Bearer sk-alice-0123456789"})
        assert got.as_numpy("embedding").shape == (1, 32)
        client.infer(name, image, headers={"x-api-key": "sk-bob-0123456789"})
        with pytest.raises(InferenceServerException) as e:  # bob: 1 item/s, burst 1
            client.infer(name, image, headers={"x-api-key": "sk-bob-0123456789"})
        assert _code(e.value) == "StatusCode.RESOURCE_EXHAUSTED"
        assert "rate limit" in e.value.message()


def test_tls_serves_grpc_too(serve: Serve, tmp_path: Any) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = serve(grpc_port=free_port(), ssl_certfile=str(cert), ssl_keyfile=str(key))
    target = f"127.0.0.1:{server.app.state.grpc_port}"
    with tg.InferenceServerClient(target, ssl=True, root_certificates=str(cert)) as client:
        got = client.infer(model_name(server), [_bytes([png_bytes(random_pixels(5))])])
        assert got.as_numpy("embedding").shape == (1, 32)
    with tg.InferenceServerClient(target) as plain, pytest.raises(InferenceServerException):
        plain.is_server_live()


def test_model_config_is_tritons_over_both_protocols(
    server: RunningServer, client: tg.InferenceServerClient
) -> None:
    import tritonclient.http as th

    name = model_name(server)
    over_http = th.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        for model in (name, name + "-uint8", name + "-text"):
            http_config = over_http.get_model_config(model)
            grpc_config = client.get_model_config(model).config
            assert grpc_config.max_batch_size == http_config["max_batch_size"]
            assert [(i.name, list(i.dims), i.optional) for i in grpc_config.input] == [
                (i["name"], i["dims"], i["optional"]) for i in http_config["input"]
            ]
            assert [o.name for o in grpc_config.output] == [
                o["name"] for o in http_config["output"]
            ]
        image = over_http.get_model_config(name)
    finally:
        over_http.close()
    assert image["max_batch_size"] == 8 and image["platform"] == "clipserve"
    assert {i["name"]: (i["data_type"], i["dims"], i["optional"]) for i in image["input"]} == {
        "image": ("TYPE_STRING", [1], True),
        "pixels": ("TYPE_UINT8", [224, 224, 3], True),
        "pixel_values": ("TYPE_FP32", [3, 224, 224], True),
        "pixel_values_fp16": ("TYPE_FP16", [3, 224, 224], True),
    }
    assert image["output"][0] == {"name": "embedding", "data_type": "TYPE_FP32", "dims": [32]}
    batching = server.config.batching
    assert image["dynamic_batching"] == {
        "preferred_batch_size": [batching.max_batch_size],
        "max_queue_delay_microseconds": round(batching.max_queue_delay_ms * 1000),
    }
    assert [g["kind"] for g in image["instance_group"]] == ["KIND_CPU"]
    uint8 = client.get_model_config(name + "-uint8").config
    assert [(i.name, i.optional) for i in uint8.input] == [("pixels", False)]
