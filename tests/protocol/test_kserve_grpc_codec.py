"""The gRPC codec on messages built by the real tritonclient.grpc: every input kind raw and
typed, the HTTP codec's errors word for word, shared-memory references, one raw output entry
per output; and the error → gRPC status table."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc._utils import _get_inference_request

from clipserve import errors
from clipserve.http.doors.kserve_grpc import peek_model
from clipserve.http.grpc_status import grpc_error
from clipserve.protocol import kserve, kserve_grpc
from clipserve.protocol.kserve import RequestedOutput
from clipserve.protocol.shm import RegionRef

SIZE = (224, 224)
JPEGS = [b"\xff\xd8\xff\xe0fake-jpeg-0", b"\xff\xd8\xff\xe0another one, longer"]


def message(
    inputs: list[tg.InferInput],
    outputs: list[tg.InferRequestedOutput] | None = None,
    model: str = "tiny",
    request_id: str = "",
) -> bytes:
    request = _get_inference_request(
        model, inputs, "", request_id, outputs, 0, False, False, 0, None, None
    )
    serialized: bytes = request.SerializeToString()
    return serialized


def parse(body: bytes, tower: Any = "image", **kw: Any) -> kserve.InferRequest:
    limits: dict[str, Any] = {"max_items": 8, "max_text_chars": 50, "datatype": None} | kw
    return kserve_grpc.parse_model_infer(body, tower=tower, size=SIZE, output="embedding", **limits)


def bytes_input(elements: list[bytes], name: str = "image") -> tg.InferInput:
    inp = tg.InferInput(name, [len(elements), 1], "BYTES")
    inp.set_data_from_numpy(np.array(elements, dtype=np.object_).reshape(-1, 1))
    return inp


def test_bytes_images_and_texts_raw_as_tritonclient_sends_them() -> None:
    request = parse(message([bytes_input(JPEGS)], request_id="r-1"))
    assert request.images == JPEGS and request.protocol == "grpc-bytes" and request.id == "r-1"
    assert request.outputs == [RequestedOutput("embedding", "FP32", True)]
    texts = parse(message([bytes_input([b"a cat", b"ein Hund"], "text")]), "text")
    assert texts.texts == ["a cat", "ein Hund"] and texts.protocol == "grpc-text"


@pytest.mark.parametrize(
    ("datatype", "dtype"), [("UINT8", np.uint8), ("FP32", np.float32), ("FP16", np.float16)]
)
def test_tensors_raw_are_views_in_the_models_layout(datatype: str, dtype: Any) -> None:
    shape = [2, 224, 224, 3] if datatype == "UINT8" else [2, 3, 224, 224]
    tensor = np.random.default_rng(0).integers(0, 255, shape).astype(dtype)
    inp = tg.InferInput("INPUT__0", shape, datatype)
    inp.set_data_from_numpy(tensor)
    request = parse(message([inp]))
    assert request.protocol == f"grpc-{datatype.lower()}"
    assert request.tensor is not None
    np.testing.assert_array_equal(request.tensor, tensor)


def test_typed_contents() -> None:
    body = pb.ModelInferRequest(model_name="tiny")
    inp = body.inputs.add(name="image", datatype="BYTES", shape=[2])
    inp.contents.bytes_contents.extend(JPEGS)
    request = parse(body.SerializeToString())
    assert request.images == JPEGS and request.protocol == "grpc-bytes-typed"
    pixels = np.arange(224 * 224 * 3, dtype=np.uint32) % 256
    body = pb.ModelInferRequest(model_name="tiny")
    inp = body.inputs.add(name="pixels", datatype="UINT8", shape=[1, 224, 224, 3])
    inp.contents.uint_contents.extend(pixels.tolist())
    request = parse(body.SerializeToString())
    assert request.tensor is not None and request.protocol == "grpc-uint8-typed"
    np.testing.assert_array_equal(request.tensor.reshape(-1), pixels.astype(np.uint8))
    inp.contents.uint_contents[0] = 256
    with pytest.raises(errors.InvalidTensor, match=r"0\.\.255"):
        parse(body.SerializeToString())
    body = pb.ModelInferRequest(model_name="tiny")
    body.inputs.add(name="x", datatype="FP16", shape=[1, 3, 224, 224])
    body.inputs[0].contents.fp32_contents.append(1.0)
    with pytest.raises(errors.InvalidTensor, match="raw_input_contents"):
        parse(body.SerializeToString())


def test_typed_contents_are_counted_before_anything_is_built_from_them() -> None:
    # A 32 MiB message holds 16M empty bytes_contents: ~3 GB of objects once listed.
    body = pb.ModelInferRequest(model_name="tiny")
    inp = body.inputs.add(name="image", datatype="BYTES", shape=[1])
    inp.contents.bytes_contents.extend([b""] * 1000)
    with pytest.raises(errors.InvalidTensor, match=r"1000 elements; shape \[1\] needs 1"):
        parse(body.SerializeToString())
    inp.shape[:] = [1000]
    with pytest.raises(errors.TooManyItems, match="limit is 8"):
        parse(body.SerializeToString())
    inp.shape[:] = [-1]
    with pytest.raises(errors.InvalidTensor, match="needs 0"):
        parse(body.SerializeToString())
    body = pb.ModelInferRequest(model_name="tiny")
    inp = body.inputs.add(name="x", datatype="FP32", shape=[9, 3, 224, 224])
    inp.contents.fp32_contents.extend([0.0] * (9 * 3 * 224 * 224))
    with pytest.raises(errors.InvalidTensor, match="more than --max-items-per-request"):
        parse(body.SerializeToString())


def test_data_given_both_raw_and_typed_is_refused() -> None:
    inp = bytes_input(JPEGS)
    body = pb.ModelInferRequest.FromString(message([inp]))
    body.inputs[0].contents.bytes_contents.append(b"another")
    with pytest.raises(errors.InvalidBody, match="twice"):
        parse(body.SerializeToString())


def test_errors_read_as_over_http() -> None:
    cases: list[tuple[bytes, type[errors.ClipserveError], str]] = [
        (b"\xff\xff\xff", errors.InvalidBody, "not a protobuf message"),
        (message([bytes_input(JPEGS), bytes_input(JPEGS, "b")]), errors.InvalidBody, "exactly one"),
        (message([bytes_input(JPEGS * 5)]), errors.TooManyItems, "8"),
        (message([bytes_input([b"x" * 60], "text")]), errors.TextTooLong, "50"),
    ]
    bad = tg.InferInput("pixels", [1, 7, 7, 3], "UINT8")
    bad.set_data_from_numpy(np.zeros((1, 7, 7, 3), np.uint8))
    cases.append((message([bad]), errors.InvalidTensor, "does not fit the model"))
    odd = tg.InferInput("x", [1], "INT64")
    odd.set_data_from_numpy(np.zeros(1, np.int64))
    cases.append((message([odd]), errors.InvalidTensor, "INT64 is not supported"))
    for body, error, text in cases:
        tower = "text" if error is errors.TextTooLong else "image"
        with pytest.raises(error, match=text):
            parse(body, tower)
    with pytest.raises(errors.InvalidTensor, match="this model takes UINT8 only"):
        parse(message([bytes_input(JPEGS)]), datatype="UINT8")
    wrong = tg.InferRequestedOutput("logits")
    with pytest.raises(errors.InvalidTensor, match="unexpected inference output"):
        parse(message([bytes_input(JPEGS)], [wrong]))
    classify = tg.InferRequestedOutput("embedding", class_count=3)
    with pytest.raises(errors.Unsupported, match="classification"):
        parse(message([bytes_input(JPEGS)], [classify]))


def test_shared_memory_references_are_read_and_written_through_the_callables() -> None:
    regions = {"in": kserve.serialize_bytes(JPEGS), "out": bytes(256)}
    inp = tg.InferInput("image", [2, 1], "BYTES")
    inp.set_shared_memory("in", len(regions["in"]))
    out = tg.InferRequestedOutput("embedding")
    out.set_shared_memory("out", 256)
    with pytest.raises(errors.InvalidTensor, match="shared memory is not served"):
        parse(message([inp], [out]))

    def read(ref: RegionRef, max_bytes: int) -> bytes:
        assert ref.byte_size <= max_bytes
        return regions[ref.name][ref.offset : ref.offset + ref.byte_size]

    request = parse(message([inp], [out]), read_region=read, max_shared_bytes=1024)
    assert request.images == JPEGS and request.protocol == "grpc-bytes-shm"
    assert request.outputs[0].region == RegionRef("out", 0, 256)
    written: dict[str, bytes] = {}
    embeddings = np.arange(6, dtype=np.float32).reshape(2, 3)
    answer = pb.ModelInferResponse.FromString(
        kserve_grpc.encode_model_infer(
            embeddings,
            model_name="tiny",
            request_id=None,
            outputs=request.outputs,
            write_region=lambda ref, data: written.update({ref.name: data}),
        )
    )
    assert written == {"out": embeddings.tobytes()}
    assert list(answer.raw_output_contents) == [b""]  # one entry per output, as Triton
    assert answer.outputs[0].parameters["shared_memory_region"].string_param == "out"


def test_a_region_is_read_only_once_its_size_fits_the_shape_or_the_body_limit() -> None:
    reads: list[tuple[RegionRef, int]] = []

    def read(ref: RegionRef, max_bytes: int) -> bytes:
        reads.append((ref, max_bytes))
        return bytes(ref.byte_size)

    pixels = tg.InferInput("pixels", [1, 224, 224, 3], "UINT8")
    pixels.set_shared_memory("in", 1 << 30)  # the whole region, not the shape's 150528 bytes
    with pytest.raises(errors.InvalidTensor, match="needs 150528 bytes; got 1073741824"):
        parse(message([pixels]), read_region=read, max_shared_bytes=4096)
    images = tg.InferInput("image", [1], "BYTES")
    images.set_shared_memory("in", 4097)
    with pytest.raises(errors.PayloadTooLarge, match="--max-body-bytes"):
        parse(message([images]), read_region=read, max_shared_bytes=4096)
    pixels.set_shared_memory("in", 224 * 224 * 3)  # the shape's size, but past the body limit
    with pytest.raises(errors.PayloadTooLarge, match="150528 exceeds 4096"):
        parse(message([pixels]), read_region=read, max_shared_bytes=4096)
    assert reads == []
    assert parse(message([pixels]), read_region=read, max_shared_bytes=1 << 20).protocol == (
        "grpc-uint8-shm"
    )
    assert reads == [(RegionRef("in", 0, 224 * 224 * 3), 224 * 224 * 3)]


def test_an_input_in_shared_memory_carries_no_data_of_its_own() -> None:
    """As over HTTP: data in the message too would leave which one counts unsaid."""
    pixels = tg.InferInput("pixels", [1, 224, 224, 3], "UINT8")
    pixels.set_data_from_numpy(np.zeros((1, 224, 224, 3), np.uint8))
    pixels.set_shared_memory("in", 224 * 224 * 3)
    body = pb.ModelInferRequest.FromString(message([pixels]))
    body.raw_input_contents.append(bytes(224 * 224 * 3))
    with pytest.raises(errors.InvalidBody, match="in shared memory, but the request carries"):
        parse(body.SerializeToString(), read_region=lambda ref, n: b"", max_shared_bytes=1 << 20)


def test_the_answer_holds_one_raw_entry_per_output_in_order() -> None:
    embeddings = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    outputs = [
        RequestedOutput("embedding_fp16", "FP16", True),
        RequestedOutput("embedding", "FP32", True),
    ]
    body = kserve_grpc.encode_model_infer(
        embeddings, model_name="tiny", request_id="r-9", outputs=outputs
    )
    result = tg.InferResult(pb.ModelInferResponse.FromString(body))
    assert result.get_response().id == "r-9" and result.get_response().model_version == "1"
    np.testing.assert_array_equal(result.as_numpy("embedding"), embeddings)
    assert result.as_numpy("embedding_fp16").dtype == np.float16


def test_the_model_is_peeked_without_parsing() -> None:
    body = message([bytes_input(JPEGS)], model="nvidia/nvclip")
    assert peek_model(body) == ("nvidia/nvclip", "")
    versioned = pb.ModelInferRequest(model_version="1", model_name="m").SerializeToString()
    assert peek_model(versioned) == ("m", "1")
    for broken in (b"\x0a\xff", b"\x0a\x05ab", b"\x0f"):
        with pytest.raises(errors.InvalidBody, match="malformed ModelInferRequest"):
            peek_model(broken)


def test_errors_map_to_tritons_grpc_status_codes() -> None:
    table = [
        (errors.InvalidImage("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.TooManyItems("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ModelNotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.RequestTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.PayloadTooLarge("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unauthorized("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.Unsupported("x"), grpc.StatusCode.UNIMPLEMENTED),
        (errors.ExecutorFailed("secret detail"), grpc.StatusCode.INTERNAL),
        (RuntimeError("secret detail"), grpc.StatusCode.INTERNAL),
    ]
    for error, code in table:
        mapped = grpc_error(error)
        assert mapped.code == code, error
        assert "secret" not in mapped.message
    busy = grpc_error(errors.Overloaded("full", retry_after_s=3))
    assert busy.code == grpc.StatusCode.UNAVAILABLE
    assert busy.trailing_metadata == (("retry-pushback-ms", "3000"),)
    assert grpc_error(errors.ShuttingDown("x")).trailing_metadata == (
        ("retry-pushback-ms", "1000"),
    )
