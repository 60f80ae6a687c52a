"""KServe v2 / Triton codec: requests built by the real tritonclient, parsed by ours, and our
responses parsed back by tritonclient's own InferResult."""

from __future__ import annotations

import base64
import warnings
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from clipserve.errors import (
    ClipserveError,
    InvalidBody,
    InvalidImage,
    InvalidTensor,
    InvalidText,
    PayloadTooLarge,
    TextTooLong,
    TooManyItems,
    TooManyTexts,
)
from clipserve.http.names import KServeModel
from clipserve.protocol import kserve
from clipserve.protocol.kserve import RequestedOutput, parse_infer_request
from clipserve.protocol.shm import RegionRef
from tests.helpers import bytes_input

SIZE = (224, 224)
JPEGS = [b"\xff\xd8\xff\xe0fake-jpeg-0", b"\xff\xd8\xff\xe0another one, longer"]


def triton_body(
    inputs: list[triton.InferInput], outputs: list[triton.InferRequestedOutput] | None = None
) -> tuple[bytes, str | None]:
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    return body, None if json_size is None else str(json_size)


def parse(body: bytes, header: str | None, tower: Any = "image", **kw: Any) -> kserve.InferRequest:
    limits = {"max_items": 8, "max_text_chars": 50} | kw
    return parse_infer_request(body, header, tower=tower, size=SIZE, **limits)


@pytest.mark.parametrize("shape", [None, [2, 1]])
def test_binary_bytes_images_as_tritonclient_sends_them(shape: list[int] | None) -> None:
    request = parse(*triton_body([bytes_input(JPEGS, binary=True, shape=shape)]))
    assert request.images == JPEGS
    assert request.protocol == "kserve-bytes"
    assert request.count == 2
    # No outputs named: tritonclient asks for every output in binary.
    assert request.outputs == [RequestedOutput("embedding", "FP32", binary=True)]


def test_json_bytes_images_are_base64() -> None:
    encoded = [base64.b64encode(j) for j in JPEGS]
    request = parse(*triton_body([bytes_input(encoded, binary=False)]))
    assert request.images == JPEGS
    assert request.protocol == "kserve-bytes-json"


def test_json_bytes_image_that_is_not_base64_names_its_item() -> None:
    with pytest.raises(InvalidImage, match="item 1: in JSON, BYTES images must be base64"):
        parse(*triton_body([bytes_input([base64.b64encode(b"x"), b"not base64!"], False)]))


@pytest.mark.parametrize(
    ("dtype", "datatype", "layout"),
    [
        (np.uint8, "UINT8", (224, 224, 3)),
        (np.float32, "FP32", (3, 224, 224)),
        (np.float16, "FP16", (3, 224, 224)),
    ],
)
@pytest.mark.parametrize("binary", [True, False])
def test_tensors_binary_and_json(
    dtype: Any, datatype: str, layout: tuple[int, ...], binary: bool
) -> None:
    rng = np.random.default_rng(0)
    array = (
        rng.integers(0, 256, (2, *layout))
        if dtype == np.uint8
        else rng.standard_normal((2, *layout))
    ).astype(dtype)
    inp = triton.InferInput("x", list(array.shape), datatype).set_data_from_numpy(array, binary)
    request = parse(*triton_body([inp]))
    assert request.tensor is not None and request.tensor.dtype == dtype
    np.testing.assert_array_equal(request.tensor, array)
    assert request.protocol == f"kserve-{datatype.lower()}" + ("" if binary else "-json")


def test_binary_tensor_is_a_view_of_the_body() -> None:
    array = np.zeros((1, 224, 224, 3), np.uint8)
    inp = triton.InferInput("x", [1, 224, 224, 3], "UINT8").set_data_from_numpy(array)
    request = parse(*triton_body([inp]))
    assert request.tensor is not None and not request.tensor.flags.owndata


def test_texts_binary_and_json() -> None:
    texts = ["a cat", "ein Hund, übrigens"]
    for binary in (True, False):
        inp = bytes_input([t.encode() for t in texts], binary, name="text")
        request = parse(*triton_body([inp]), tower="text")
        assert request.texts == texts
        assert request.protocol == "kserve-text" + ("" if binary else "-json")


def test_requested_outputs_and_binary_flags() -> None:
    inp = bytes_input(JPEGS, binary=True)
    outputs = [
        triton.InferRequestedOutput("embedding_fp16", binary_data=False),
        triton.InferRequestedOutput("embedding", binary_data=True),
    ]
    request = parse(*triton_body([inp], outputs))
    assert request.outputs == [
        RequestedOutput("embedding_fp16", "FP16", False),
        RequestedOutput("embedding", "FP32", True),
    ]


def test_plain_json_request_without_outputs_answers_json() -> None:
    doc = {
        "id": "42",
        "inputs": [
            {
                "name": "image",
                "shape": [1],
                "datatype": "BYTES",
                "data": [base64.b64encode(JPEGS[0]).decode()],
            }
        ],
    }
    request = parse(orjson.dumps(doc), None)
    assert request.id == "42" and request.images == JPEGS[:1]
    assert request.outputs == [RequestedOutput("embedding", "FP32", binary=False)]


def _binary_header(shape: list[int], datatype: str, size: int) -> bytes:
    spec = {
        "name": "x",
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }
    return orjson.dumps({"inputs": [spec]})


def _uint8(shape: list[int], data: bytes | None = None) -> tuple[bytes, str]:
    payload = data if data is not None else bytes(int(np.prod(shape)))
    header = _binary_header(shape, "UINT8", len(payload))
    return header + payload, str(len(header))


def _doc(inp: dict[str, Any], **extra: Any) -> tuple[bytes, None]:
    return orjson.dumps({"inputs": [inp], **extra}), None


@pytest.mark.parametrize(
    ("args", "kw", "error", "message"),
    [
        (_uint8([1, 224, 224, 4]), {}, InvalidTensor, r"UINT8 inputs are NHWC \[N, 224, 224, 3\]"),
        (_uint8([1, 3, 224, 224]), {}, InvalidTensor, "does not fit the model"),
        (_uint8([9, 224, 224, 3]), {}, TooManyItems, "9 images in one request; the limit is 8"),
        (_uint8([1, 224, 224, 3], b"\0" * 10), {}, InvalidTensor, "needs 150528 bytes; got 10"),
        (
            _doc({"name": "x", "shape": [1, 224, 224, 3], "datatype": "INT64", "data": [1]}),
            {},
            InvalidTensor,
            "datatype INT64 is not supported",
        ),
        (
            _doc({"name": "x", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": [1.0] * 5}),
            {},
            InvalidTensor,
            "holds 5 values; shape",
        ),
        (
            _doc({"name": "x", "shape": [1, 1, 1, 3], "datatype": "UINT8", "data": [1, 2, 300]}),
            {"size": (1, 1)},
            InvalidTensor,
            "within 0..255",
        ),
        (
            _doc({"name": "x", "shape": [2, 2], "datatype": "BYTES", "data": ["a"] * 4}),
            {},
            InvalidTensor,
            r"BYTES inputs are \[N\] or \[N, 1\]",
        ),
        (
            _doc({"name": "x", "shape": [0], "datatype": "BYTES", "data": []}),
            {},
            InvalidTensor,
            "holds no elements",
        ),
        (
            _doc({"name": "x", "shape": [2], "datatype": "BYTES", "data": ["aGk="]}),
            {},
            InvalidTensor,
            "holds 1 elements; the shape says 2",
        ),
        (
            _doc({"name": "x", "shape": [1], "datatype": "BYTES"}),
            {},
            InvalidBody,
            "neither data nor binary_data_size",
        ),
        (
            _doc(
                {"name": "x", "shape": [1], "datatype": "BYTES", "data": ["aGk="]},
                outputs=[{"name": "logits"}],
            ),
            {},
            InvalidTensor,
            "unexpected inference output 'logits'",
        ),
        (
            _doc(
                {"name": "x", "shape": [1], "datatype": "BYTES", "data": ["aGk="]},
                outputs=[{"name": "embedding", "parameters": {"binary_data": "yes"}}],
            ),
            {},
            InvalidTensor,
            "\"binary_data\" must be true or false, not 'yes'",
        ),
        ((orjson.dumps({"inputs": []}), None), {}, InvalidBody, "exactly one input tensor; got 0"),
        ((b"{not json", None), {}, InvalidBody, "malformed JSON"),
        ((b"{}", "9999"), {}, InvalidBody, "not a length within the 2-byte body"),
    ],
)
def test_invalid_requests_are_refused_with_a_reason(
    args: tuple[bytes, str | None], kw: dict[str, Any], error: type[ClipserveError], message: str
) -> None:
    size = kw.pop("size", SIZE)
    with pytest.raises(error, match=message):
        parse_infer_request(*args, tower="image", size=size, max_items=8, max_text_chars=50)


def test_malformed_binary_bytes_elements() -> None:
    good = kserve.serialize_bytes(JPEGS)
    for raw, message in [
        (good[:-1], "element 1: its length runs past"),
        (good + b"\x01\x00", "more than the 2 elements"),
        (kserve.serialize_bytes(JPEGS[:1]), "holds 1 elements; the shape says 2"),
        (good[:2], "truncated length prefix"),
    ]:
        header = _binary_header([2], "BYTES", len(raw))
        with pytest.raises(InvalidTensor, match=message):
            parse(header + raw, str(len(header)))


def test_binary_size_must_match_the_bytes_after_the_header() -> None:
    body, header = _uint8([1, 224, 224, 3])
    with pytest.raises(InvalidBody, match="does not match the 150529 bytes"):
        parse(body + b"\0", header)


def test_text_limits() -> None:
    with pytest.raises(TooManyTexts, match="9 texts in one request"):
        parse(*triton_body([bytes_input([b"a"] * 9, True)]), tower="text")
    with pytest.raises(TextTooLong, match="item 1: 51 characters"):
        parse(*triton_body([bytes_input([b"a", b"b" * 51], True)]), tower="text")
    with pytest.raises(InvalidText, match="item 0: not UTF-8"):
        parse(*triton_body([bytes_input([b"\xff\xfe"], True)]), tower="text")
    with pytest.raises(InvalidTensor, match="the text model takes BYTES"):
        parse(*_uint8([1, 224, 224, 3]), tower="text")


@pytest.mark.parametrize("binary", [True, False])
def test_responses_parse_with_tritonclient(binary: bool) -> None:
    embeddings = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    outputs = [
        RequestedOutput("embedding", "FP32", binary),
        RequestedOutput("embedding_fp16", "FP16", binary),
    ]
    body, headers, media = kserve.encode_infer_response(
        embeddings, model_name="tiny", request_id="r1", outputs=outputs
    )
    length = headers.get(kserve.HEADER_LENGTH)
    assert (length is not None) == binary
    assert media == ("application/octet-stream" if binary else "application/json")
    result = triton.InferResult.from_response_body(body, header_length=length and int(length))
    fp32, fp16 = result.as_numpy("embedding"), result.as_numpy("embedding_fp16")
    assert fp32.dtype == np.float32 and fp16.dtype == np.float16
    np.testing.assert_array_equal(fp32, embeddings)
    np.testing.assert_array_equal(fp16, embeddings.astype(np.float16))
    response = result.get_response()
    assert response["model_name"] == "tiny" and response["id"] == "r1"


def test_metadata_describes_the_model() -> None:
    meta = kserve.model_metadata("tiny", KServeModel("image"), (224, 256), 32, "embedding")
    shapes = {i["datatype"]: i["shape"] for i in meta["inputs"]}
    assert shapes == {
        "BYTES": [-1, 1],  # perf_analyzer drops the batch dimension and needs one left
        "UINT8": [-1, 224, 256, 3],
        "FP32": [-1, 3, 224, 256],
        "FP16": [-1, 3, 224, 256],
    }
    assert [(o["name"], o["datatype"], o["shape"]) for o in meta["outputs"]] == [
        ("embedding", "FP32", [-1, 32]),
        ("embedding_fp16", "FP16", [-1, 32]),
    ]
    text = kserve.model_metadata("tiny-text", KServeModel("text"), (224, 224), 32, "out")
    assert text["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]
    assert [o["name"] for o in text["outputs"]] == ["out", "out_fp16"]
    uint8 = kserve.model_metadata("tiny-uint8", KServeModel("image", "UINT8"), (224, 224), 32, "e")
    assert uint8["inputs"] == [{"name": "pixels", "datatype": "UINT8", "shape": [-1, 224, 224, 3]}]


def test_a_per_kind_model_takes_its_datatype_only() -> None:
    body, headers = kserve.build_infer_request(JPEGS)
    assert parse(body, headers[kserve.HEADER_LENGTH], datatype="BYTES").images == JPEGS
    with pytest.raises(InvalidTensor, match="this model takes UINT8 only"):
        parse(body, headers[kserve.HEADER_LENGTH], datatype="UINT8")


def test_build_infer_request_round_trips() -> None:
    body, headers = kserve.build_infer_request(JPEGS, binary_output=False)
    request = parse(body, headers[kserve.HEADER_LENGTH])
    assert request.images == JPEGS and request.outputs == [
        RequestedOutput("embedding", "FP32", False)
    ]
    tensor = np.ones((2, 3, 224, 224), np.float16)
    body, headers = kserve.build_infer_request(tensor=tensor, output="embedding_fp16")
    request = parse(body, headers[kserve.HEADER_LENGTH])
    assert request.protocol == "kserve-fp16" and request.tensor is not None
    body, headers = kserve.build_infer_request(texts=["a", "b"])
    assert parse(body, headers[kserve.HEADER_LENGTH], tower="text").texts == ["a", "b"]


def test_hostile_headers_are_4xx_not_500() -> None:
    from clipserve.errors import ClipserveError

    body = b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["aGk="]}]}'
    for length in ("\u00b2", "9" * 5000, "-1", " 12 "[:0] + "1e3"):
        with pytest.raises(ClipserveError):
            kserve.split_body(body, length)
    doc = (
        b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["aGk="]}],'
        b' "outputs": [{"name": ["x"]}]}'
    )
    with pytest.raises(ClipserveError, match="unexpected inference output"):
        kserve.parse_infer_request(
            doc, None, tower="image", size=(224, 224), max_items=8, max_text_chars=100
        )


def test_container_floods_are_refused_before_parsing() -> None:
    import tracemalloc

    from clipserve.errors import TooManyItems

    flood = (
        b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ['
        + (b"[]," * 1_000_000)
        + b'"aGk="]}]}'
    )
    tracemalloc.start()
    try:
        with pytest.raises(TooManyItems, match="arrays and objects"):
            kserve.parse_infer_request(
                flood, None, tower="image", size=(224, 224), max_items=8, max_text_chars=100
            )
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_string_floods_are_refused_before_parsing() -> None:
    from clipserve.errors import TooManyItems

    def texts(items: list[str]) -> bytes:
        inputs = [{"name": "t", "datatype": "BYTES", "shape": [len(items)], "data": items}]
        return orjson.dumps({"inputs": inputs})

    def parse(body: bytes) -> kserve.InferRequest:
        return kserve.parse_infer_request(
            body, None, tower="text", size=(224, 224), max_items=8, max_text_chars=100
        )

    with pytest.raises(TooManyItems, match="strings"):
        parse(texts(["a"] * 100_000))
    quoted = ['he said "hi", then \\"bye\\"' * 3] * 8  # escaped quotes are not strings
    assert parse(texts(quoted)).texts == quoted


class Region:
    """A region's bytes, and each read the codec asks of it (its ref and its cap)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.reads: list[tuple[RegionRef, int]] = []

    def read(self, ref: RegionRef, max_bytes: int) -> bytes:
        self.reads.append((ref, max_bytes))
        return self.data[ref.offset : ref.offset + ref.byte_size]


def shm_body(datatype: str, shape: list[int], byte_size: int) -> bytes:
    params = {"shared_memory_region": "r", "shared_memory_byte_size": byte_size}
    spec = {"name": "x", "datatype": datatype, "shape": shape, "parameters": params}
    return orjson.dumps({"inputs": [spec]})


def test_a_region_is_read_only_once_its_size_fits_the_shape_or_the_body_limit() -> None:
    pixels = np.arange(2 * 224 * 224 * 3, dtype=np.uint8).reshape(2, 224, 224, 3)
    region = Region(pixels.tobytes() + bytes(1 << 20))  # the client names its whole region
    shared = {"read_region": region.read, "max_shared_bytes": 4096}
    whole = shm_body("UINT8", [2, 224, 224, 3], len(region.data))
    with pytest.raises(InvalidTensor, match=r"needs 301056 bytes; got 1349632"):
        parse(whole, None, **shared)
    fitting = shm_body("UINT8", [2, 224, 224, 3], pixels.nbytes)
    with pytest.raises(PayloadTooLarge, match=r"301056 exceeds 4096 bytes"):  # as a body would
        parse(fitting, None, **shared)
    assert region.reads == []  # refused unread: a region may be 1 GiB
    request = parse(fitting, None, **{**shared, "max_shared_bytes": 1 << 20})
    assert request.protocol == "kserve-uint8-shm"
    np.testing.assert_array_equal(request.tensor, pixels)
    assert region.reads == [(RegionRef("r", 0, pixels.nbytes), pixels.nbytes)]

    # BYTES: no shape says how many bytes; at most --max-body-bytes, as in a body.
    region = Region(kserve.serialize_bytes(JPEGS) + bytes(8192))
    shared["read_region"] = region.read
    with pytest.raises(PayloadTooLarge, match=r"exceeds 4096 bytes \(--max-body-bytes\)"):
        parse(shm_body("BYTES", [2], len(region.data)), None, **shared)
    assert region.reads == []
    encoded = len(kserve.serialize_bytes(JPEGS))
    assert parse(shm_body("BYTES", [2], encoded), None, **shared).images == JPEGS
    assert region.reads == [(RegionRef("r", 0, encoded), 4096)]
    # Binary data after the header as well: which is the input? Refused, nothing read.
    body = shm_body("BYTES", [2], encoded)
    with pytest.raises(InvalidBody, match="is in shared memory"):
        parse(body + b"data", str(len(body)), **shared)
    assert len(region.reads) == 1


def test_fp16_json_out_of_range_is_refused_without_a_numpy_warning() -> None:
    """70000 is past float16's range: a 400, and no RuntimeWarning (a log line per request)."""
    values = [70000.0] + [0.0] * (3 * 224 * 224 - 1)
    doc = {"inputs": [{"name": "x", "datatype": "FP16", "shape": [1, 3, 224, 224], "data": values}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InvalidTensor):
            parse(orjson.dumps(doc), None)
