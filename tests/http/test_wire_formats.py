"""Every wire format end to end on real uvicorn: round trips, parity, and each specific error."""

from __future__ import annotations

import base64
import struct
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import torch

from clipserve.backends.base import normalise_numpy
from clipserve.inference.preprocess import PreprocessSpec
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    png_bytes,
    post,
    random_pixels,
    reference_embedding,
)

MSGPACK = {"Content-Type": "application/msgpack"}


@pytest.fixture
def server(serve: Serve) -> RunningServer:
    return serve(max_items_per_request=8, max_batch_size=8)


def spec_of(server: RunningServer) -> PreprocessSpec:
    return server.state.runtime.model.preprocess


def tensor_msg(array: np.ndarray, dtype: str | None = None, shape: Any = None) -> bytes:
    return msgpack.packb(
        {
            "tensor": {
                "dtype": dtype or str(array.dtype),
                "shape": list(array.shape) if shape is None else shape,
                "data": array.tobytes(),
            }
        }
    )


def raw_headers(array: np.ndarray) -> dict[str, str]:
    return {
        "Content-Type": "application/octet-stream",
        "X-Tensor-Dtype": str(array.dtype),
        "X-Tensor-Shape": ",".join(map(str, array.shape)),
    }


def embeddings(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32)


def test_every_format_gives_the_same_embedding(server: RunningServer, tiny_model: Any) -> None:
    pixels = np.stack([random_pixels(1), random_pixels(2)])
    want = np.stack([reference_embedding(tiny_model, p) for p in pixels])
    floats = normalise_numpy(pixels, spec_of(server))
    pngs = [png_bytes(p) for p in pixels]
    answers = {
        "uint8 msgpack": embeddings(post(server, tensor_msg(pixels), MSGPACK)),
        "float32 msgpack": embeddings(post(server, tensor_msg(floats), MSGPACK)),
        "uint8 raw": embeddings(post(server, pixels.tobytes(), raw_headers(pixels))),
        "float32 raw": embeddings(post(server, floats.tobytes(), raw_headers(floats))),
        "images msgpack": embeddings(post(server, msgpack.packb({"images": pngs}), MSGPACK)),
        "json base64": embeddings(
            post(
                server,
                httpx.Response(
                    200, json={"images": [base64.b64encode(b).decode() for b in pngs]}
                ).content,
                {"Content-Type": "application/json"},
            )
        ),
        "multipart": embeddings(
            httpx.post(
                server.url + "/embed",
                timeout=60,
                files=[
                    ("image", ("a.png", pngs[0], "image/png")),
                    ("image", ("b.png", pngs[1], "image/png")),
                ],
            )
        ),
    }
    for name, got in answers.items():
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
    f16 = embeddings(post(server, tensor_msg(floats.astype(np.float16)), MSGPACK))
    cos = (f16 * want).sum(1) / np.linalg.norm(f16, axis=1)
    assert cos.min() >= 0.999  # float16 input: within the FP16 tolerance


def test_response_formats(server: RunningServer) -> None:
    pixels = np.stack([random_pixels(3), random_pixels(4)])
    body, headers = tensor_msg(pixels), MSGPACK
    as_json = embeddings(post(server, body, headers))
    packed = post(server, body, {**headers, "Accept": "application/msgpack"})
    assert packed.headers["content-type"] == "application/msgpack"
    doc = msgpack.unpackb(packed.content)
    t = doc["embeddings"]
    assert t["dtype"] == "float32" and t["shape"] == [2, 32] and doc["dim"] == 32
    np.testing.assert_allclose(np.frombuffer(t["data"], "<f4").reshape(2, 32), as_json, atol=1e-6)
    raw = post(server, body, {**headers, "Accept": "application/octet-stream"})
    assert raw.headers["x-embedding-shape"] == "2,32"
    np.testing.assert_allclose(np.frombuffer(raw.content, "<f4").reshape(2, 32), as_json, atol=1e-6)
    half = post(
        server, body, {**headers, "Accept": "application/octet-stream"}, "/embed?dtype=float16"
    )
    assert half.headers["x-embedding-dtype"] == "float16" and len(half.content) == 2 * 32 * 2
    np.testing.assert_allclose(
        np.frombuffer(half.content, "<f2").reshape(2, 32), as_json, atol=2e-3
    )
    json_half = embeddings(post(server, body, headers, "/embed?dtype=float16"))
    np.testing.assert_allclose(json_half, as_json, atol=2e-3)
    assert not np.array_equal(json_half, as_json)  # really rounded to float16
    single = post(
        server, png_bytes(pixels[0]), {"Content-Type": "image/png", "Accept": "application/msgpack"}
    )
    assert msgpack.unpackb(single.content)["embedding"]["shape"] == [32]
    refused = post(server, body, {**headers, "Accept": "text/csv"})
    assert refused.status_code == 406 and refused.json()["error"]["code"] == "not_acceptable"


def _bad(
    server: RunningServer,
    body: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
    fragment: str,
) -> None:
    r = post(server, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    assert fragment in error["message"], error


GOOD = np.zeros((1, 224, 224, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("body", "headers", "status", "code", "fragment"),
    [
        (b"\xc1\xc1\xc1", MSGPACK, 400, "invalid_body", "malformed msgpack"),
        (msgpack.packb([1, 2]), MSGPACK, 400, "invalid_body", '"images" or "tensor"'),
        (msgpack.packb({"images": ["text, not bin"]}), MSGPACK, 400, "invalid_body", "item 0"),
        (tensor_msg(GOOD.astype(np.int64), "int64"), MSGPACK, 400, "invalid_tensor", "int64"),
        (tensor_msg(GOOD, shape=[1, 224, 224]), MSGPACK, 400, "invalid_tensor", "rank 3"),
        (tensor_msg(GOOD, shape=[1, 3, 224, 224]), MSGPACK, 400, "invalid_tensor", "NHWC"),
        (tensor_msg(GOOD, shape=[1, -224, 224, 3]), MSGPACK, 400, "invalid_tensor", "negative"),
        (tensor_msg(GOOD, shape=[1, 2**40, 224, 3]), MSGPACK, 400, "invalid_tensor", "absurd"),
        (tensor_msg(GOOD, shape=[0, 224, 224, 3]), MSGPACK, 400, "invalid_tensor", "no images"),
        (tensor_msg(GOOD, shape=[9, 224, 224, 3]), MSGPACK, 413, "too_many_items", "9 images"),
        (tensor_msg(GOOD, shape=[2, 224, 224, 3]), MSGPACK, 400, "invalid_tensor", "needs"),
        (
            tensor_msg(np.full((1, 3, 224, 224), np.nan, np.float32)),
            MSGPACK,
            400,
            "invalid_tensor",
            "NaN",
        ),
        (
            tensor_msg(np.full((1, 3, 224, 224), np.inf, np.float16)),
            MSGPACK,
            400,
            "invalid_tensor",
            "infinite",
        ),
        (GOOD.tobytes()[:1000], raw_headers(GOOD), 400, "invalid_tensor", "got 1000"),
        (
            GOOD.tobytes(),
            {"Content-Type": "application/octet-stream"},
            400,
            "invalid_body",
            "X-Tensor-Dtype",
        ),
        (
            GOOD.tobytes(),
            {**raw_headers(GOOD), "X-Tensor-Shape": "one,two"},
            400,
            "invalid_tensor",
            "integers",
        ),
        (
            msgpack.packb({"images": [png_bytes(random_pixels(0))] * 9}),
            MSGPACK,
            413,
            "too_many_items",
            "9 images",
        ),
        (
            msgpack.packb({"images": [png_bytes(random_pixels(0)), b"junk"]}),
            MSGPACK,
            400,
            "invalid_image",
            "item 1",
        ),
        (
            b'{"images": ["%%%"]}',
            {"Content-Type": "application/json"},
            400,
            "invalid_body",
            "base64",
        ),
        (b'{"images": ', {"Content-Type": "application/json"}, 400, "invalid_body", "malformed"),
        (
            b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nhello\r\n--x--\r\n',
            {"Content-Type": "multipart/form-data; boundary=x"},
            400,
            "invalid_body",
            "not a file",
        ),
        (b"whatever", {"Content-Type": "multipart/form-data"}, 400, "invalid_body", "boundary"),
        (b"x", {"Content-Type": "application/xml"}, 415, "unsupported_media_type", "xml"),
    ],
    ids=[
        "msgpack-garbage",
        "msgpack-shape",
        "msgpack-str-image",
        "dtype",
        "rank",
        "layout",
        "negative",
        "absurd",
        "empty",
        "too-many",
        "length",
        "nan",
        "inf16",
        "truncated-raw",
        "raw-no-headers",
        "raw-bad-shape",
        "too-many-images",
        "bad-item",
        "bad-base64",
        "bad-json",
        "multipart-field",
        "multipart-no-boundary",
        "media",
    ],
)
def test_bad_requests_get_their_specific_error(
    server: RunningServer,
    body: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
    fragment: str,
) -> None:
    _bad(server, body, headers, status, code, fragment)
    assert post(server, tensor_msg(GOOD), MSGPACK).status_code == 200  # still serving


def test_truncated_body_is_refused(server: RunningServer) -> None:
    body = tensor_msg(GOOD)
    _bad(server, body[: len(body) // 2], MSGPACK, 400, "invalid_body", "malformed msgpack")


def test_per_protocol_metrics_and_timing(server: RunningServer) -> None:
    r = post(server, tensor_msg(GOOD), MSGPACK)
    assert {"receive", "decode", "queue", "compute", "encode"} <= set(
        part.split(";")[0].strip() for part in r.headers["server-timing"].split(",")
    )
    text = httpx.get(server.url + "/metrics").text
    assert 'clipserve_request_bytes_total{protocol="msgpack-tensor"}' in text
    assert 'clipserve_response_bytes_total{protocol="msgpack-tensor"}' in text
    assert (
        'clipserve_stage_duration_seconds_count{protocol="msgpack-tensor",stage="decode"}' in text
    )


def test_text_embeddings_match_open_clip(server: RunningServer, tiny_model: Any) -> None:
    import open_clip

    texts = ["a photo of a cat", "a diagram", ""]
    r = httpx.post(server.url + "/embed/text", json={"texts": texts}, timeout=60)
    got = embeddings(r)
    tokenizer = open_clip.get_tokenizer(server.state.runtime.model.name)
    with torch.inference_mode():
        want = tiny_model.encode_text(tokenizer(texts), normalize=True).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    accept = {**MSGPACK, "Accept": "application/msgpack"}
    packed = post(server, msgpack.packb({"texts": texts}), accept, "/embed/text")
    t = msgpack.unpackb(packed.content)["embeddings"]
    np.testing.assert_allclose(np.frombuffer(t["data"], "<f4").reshape(3, 32), want, atol=1e-5)
    assert "clipserve_text_items_total 6.0" in httpx.get(server.url + "/metrics").text


@pytest.mark.parametrize(
    ("doc", "status", "code"),
    [
        ({"texts": ["x"] * 9}, 413, "too_many_texts"),
        ({"texts": ["x" * 1001]}, 413, "text_too_long"),
        ({"texts": []}, 400, "invalid_text"),
        ({"texts": ["ok", 3]}, 400, "invalid_text"),
        ({"prompts": ["x"]}, 400, "invalid_body"),
    ],
)
def test_text_errors(server: RunningServer, doc: dict[str, Any], status: int, code: str) -> None:
    r = httpx.post(server.url + "/embed/text", json=doc, timeout=60)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    r = post(server, b"x", PNG, "/embed/text")
    assert r.status_code == 415


def test_struct_sanity() -> None:  # the raw format is little-endian float32 by contract
    assert struct.pack("<f", 1.0) == np.float32(1.0).astype("<f4").tobytes()
