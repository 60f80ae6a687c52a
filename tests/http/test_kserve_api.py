"""KServe v2 / Triton HTTP end to end with the real `tritonclient[http]` against real uvicorn and
the tiny open_clip model; answers compared with /embed and /embed/text."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from clipserve.backends.base import normalise_numpy
from clipserve.protocol import kserve
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    bytes_input,
    embed_image,
    embed_text,
    model_name,
    png_bytes,
    random_pixels,
    reference_embedding,
    until_async,
)


@pytest.fixture(scope="module")
def server(module_server: RunningServer) -> RunningServer:
    return module_server


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


def test_health_and_metadata(server: RunningServer, client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(model_name(server))
    assert client.is_model_ready(model_name(server) + "-text", model_version="1")
    assert not client.is_model_ready("resnet50")
    meta = client.get_server_metadata()
    assert meta["name"] == "clipserve" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata(model_name(server))
    assert model["name"] == model_name(server) and model["versions"] == ["1"]
    assert {i["datatype"]: i["shape"] for i in model["inputs"]} == {
        "BYTES": [-1, 1],
        "UINT8": [-1, 224, 224, 3],
        "FP32": [-1, 3, 224, 224],
        "FP16": [-1, 3, 224, 224],
    }
    assert {o["name"]: (o["datatype"], o["shape"]) for o in model["outputs"]} == {
        "embedding": ("FP32", [-1, 32]),
        "embedding_fp16": ("FP16", [-1, 32]),
    }
    text = client.get_model_metadata(model_name(server) + "-text", model_version="1")
    assert text["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_images_equal_embed(
    server: RunningServer, client: triton.InferenceServerClient, tiny_model: Any, binary: bool
) -> None:
    pixels = [random_pixels(s) for s in (10, 11)]
    images = [png_bytes(p) for p in pixels]
    # JSON cannot carry raw bytes (tritonclient refuses non-UTF-8): base64 there.
    elements = images if binary else [base64.b64encode(i) for i in images]
    result = client.infer(model_name(server), [bytes_input(elements, binary)], request_id="req-1")
    got = result.as_numpy("embedding")
    assert got.dtype == np.float32 and got.shape == (2, 32)
    for i, image in enumerate(images):
        np.testing.assert_allclose(got[i], embed_image(server, image), atol=1e-6)
    np.testing.assert_allclose(got[0], reference_embedding(tiny_model, pixels[0]), atol=1e-5)
    assert result.get_response()["id"] == "req-1"


@pytest.mark.parametrize(
    ("datatype", "dtype"), [("UINT8", np.uint8), ("FP32", np.float32), ("FP16", np.float16)]
)
@pytest.mark.parametrize("binary", [True, False])
def test_tensors_equal_embed(
    server: RunningServer,
    client: triton.InferenceServerClient,
    datatype: str,
    dtype: Any,
    binary: bool,
) -> None:
    pixels = np.stack([random_pixels(20), random_pixels(21)])
    if datatype == "UINT8":
        tensor = pixels
    else:  # normalised NCHW with the model's own mean/std, as GET /info gives them
        spec = server.state.runtime.model.preprocess
        tensor = normalise_numpy(pixels, spec).astype(dtype)
    inp = triton.InferInput("INPUT__0", list(tensor.shape), datatype)
    inp.set_data_from_numpy(tensor, binary_data=binary)
    got = client.infer(model_name(server), [inp]).as_numpy("embedding")
    tolerance = 2e-3 if datatype == "FP16" else 1e-5
    for i in range(2):
        np.testing.assert_allclose(
            got[i], embed_image(server, png_bytes(pixels[i])), atol=tolerance
        )


def test_text_model_equals_embed_text(
    server: RunningServer, client: triton.InferenceServerClient
) -> None:
    texts = ["a photo of a cat", "ein Hund"]
    expected = embed_text(server, texts)
    for binary in (True, False):
        inp = bytes_input([t.encode() for t in texts], binary, "text")
        got = client.infer(model_name(server) + "-text", [inp], model_version="1").as_numpy(
            "embedding"
        )
        np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("binary", [True, False])
def test_requested_outputs_fp16_and_json(
    server: RunningServer, client: triton.InferenceServerClient, binary: bool
) -> None:
    image = png_bytes(random_pixels(30))
    outputs = [
        triton.InferRequestedOutput("embedding_fp16", binary_data=binary),
        triton.InferRequestedOutput("embedding", binary_data=not binary),
    ]
    result = client.infer(model_name(server), [bytes_input([image], True)], outputs=outputs)
    fp16, fp32 = result.as_numpy("embedding_fp16"), result.as_numpy("embedding")
    assert fp16.dtype == np.float16 and fp32.dtype == np.float32
    np.testing.assert_allclose(fp32[0], embed_image(server, image), atol=1e-6)
    np.testing.assert_array_equal(fp16, fp32.astype(np.float16))


def test_timing_request_id_and_protocol_metrics(server: RunningServer) -> None:
    body, headers = kserve.build_infer_request([png_bytes(random_pixels(40))])
    r = httpx.post(
        f"{server.url}/v2/models/{model_name(server)}/infer",
        content=body,
        headers={**headers, "X-Request-Id": "kserve-7"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "kserve-7"
    stages = dict(re.findall(r"(\w+);dur=([0-9.]+)", r.headers["server-timing"]))
    assert {"receive", "decode", "queue", "compute", "encode"} <= set(stages)
    length = int(r.headers[kserve.HEADER_LENGTH])
    assert len(r.content) == length + 32 * 4  # one FP32 embedding after the JSON header
    text = httpx.get(server.url + "/metrics").text
    assert 'clipserve_stage_duration_seconds_count{protocol="kserve-bytes",stage="compute"}' in text
    assert 'route="/v2/models/{name}/infer"' in text


def _infer_error(
    client: triton.InferenceServerClient, model: str, inputs: list[Any], **kw: Any
) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs, **kw)
    return info.value


def test_errors_are_triton_style(
    server: RunningServer, client: triton.InferenceServerClient
) -> None:
    image = [png_bytes(random_pixels(50))]
    e = _infer_error(client, "resnet50", [bytes_input(image, True)])
    assert e.status() == "404" and "unknown model: 'resnet50'" in e.message()
    e = _infer_error(client, model_name(server), [bytes_input(image, True)], model_version="2")
    assert e.status() == "404" and "version 2" in e.message()

    wrong_shape = np.zeros((1, 3, 224, 224), np.uint8)
    inp = triton.InferInput("x", [1, 3, 224, 224], "UINT8").set_data_from_numpy(wrong_shape)
    e = _infer_error(client, model_name(server), [inp])
    assert e.status() == "400" and "UINT8 inputs are NHWC [N, 224, 224, 3]" in e.message()

    ints = np.zeros((1, 3, 224, 224), np.int32)
    inp = triton.InferInput("x", [1, 3, 224, 224], "INT32").set_data_from_numpy(ints)
    e = _infer_error(client, model_name(server), [inp])
    assert e.status() == "400" and "datatype INT32 is not supported" in e.message()

    e = _infer_error(client, model_name(server), [bytes_input([b"not an image"], True)])
    assert e.status() == "400" and "item 0:" in e.message()

    e = _infer_error(client, model_name(server), [bytes_input(image * 9, True)])
    assert e.status() == "413" and "9 images in one request; the limit is 8" in e.message()

    e = _infer_error(
        client,
        model_name(server) + "-text",
        [bytes_input(image, True)],
        outputs=[triton.InferRequestedOutput("logits")],
    )
    assert e.status() == "400" and "unexpected inference output 'logits'" in e.message()

    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("resnet50")
    assert info.value.status() == "404"


def test_unknown_v2_path_and_compressed_body_answer_triton_errors(server: RunningServer) -> None:
    r = httpx.post(server.url + "/v2/repository/models/x/load")  # model control: not offered
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    body, headers = kserve.build_infer_request([b"x"])
    r = httpx.post(
        f"{server.url}/v2/models/{model_name(server)}/infer",
        content=body,
        headers={**headers, "Content-Encoding": "gzip"},
    )
    assert r.status_code == 415 and "Content-Encoding gzip" in r.json()["error"]


# A method each KServe route does not take, and the methods it does (Allow). Model names may
# hold slashes, so a GET of an inference path used to reach the metadata route as the model
# "<name>/infer" (404 "unknown model").
WRONG_METHODS = [
    ("GET", "/v2/models/{m}/infer", "POST"),
    ("HEAD", "/v2/models/{m}/infer", "POST"),
    ("GET", "/v2/models/{m}/versions/1/infer", "POST"),
    ("GET", "/v2/models/{m}-text/infer", "POST"),
    ("PUT", "/v2/models/{m}/infer", "POST"),
    ("POST", "/v2/models/{m}", "GET, HEAD"),
    ("POST", "/v2/models/{m}/versions/1", "GET, HEAD"),
    ("POST", "/v2/models/{m}/ready", "GET, HEAD"),
    ("POST", "/v2/models/{m}/config", "GET, HEAD"),
    ("POST", "/v2/models/{m}/versions/1/stats", "GET, HEAD"),
    ("POST", "/v2/models/stats", "GET, HEAD"),
    ("GET", "/v2/repository/index", "POST"),
    ("POST", "/v2/health/ready", "GET, HEAD"),
    ("DELETE", "/v2", "GET, HEAD"),
    ("GET", "/v2/systemsharedmemory/region/r/register", "POST"),
]


def _methods(allow: str) -> set[str]:
    return {method.strip() for method in allow.split(",")}


@pytest.mark.parametrize(("method", "path", "allow"), WRONG_METHODS)
def test_a_method_a_route_does_not_take_is_405_with_allow(
    server: RunningServer, method: str, path: str, allow: str
) -> None:
    url = server.url + path.format(m=model_name(server))
    r = httpx.request(method, url, timeout=30)
    assert r.status_code == 405, r.text
    assert _methods(r.headers["allow"]) == _methods(allow)  # Starlette's order is a set's
    if method != "HEAD":  # Triton's error shape, as tritonclient reads it
        assert r.json() == {"error": f"{method} {url.removeprefix(server.url)}: Method Not Allowed"}


def test_overload_is_503_with_retry_after(serve: Serve) -> None:
    server = serve(
        backend="fake",
        backend_option=["latency_ms=1000"],
        max_batch_size=1,
        max_queue_size=1,
        max_items_per_request=1,
    )
    image = png_bytes(random_pixels(1))
    batcher = server.state.towers["image"]
    body, headers = kserve.build_infer_request([image])

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as h:
            first = asyncio.create_task(h.post("/embed", content=image, headers=PNG))
            await until_async(
                lambda: any(w.running for w in batcher.workers)
            )  # its slot is free again
            second = asyncio.create_task(h.post("/embed", content=image, headers=PNG))
            await until_async(lambda: batcher.admission.used == 1)  # queued: holds the only slot
            third = await h.post(
                f"/v2/models/{model_name(server)}/infer", content=body, headers=headers
            )
            assert [(await r).status_code for r in (first, second)] == [200, 200]
            return third

    r = asyncio.run(scenario())
    assert r.status_code == 503 and "retry later" in r.json()["error"]
    assert int(r.headers["retry-after"]) >= 1
