"""OpenAI embeddings codec: inputs split into texts and images, limits checked before decoding,
responses that the openai package's own models accept."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
import pytest
from openai.types import CreateEmbeddingResponse, Model

from clipserve.errors import (
    ClipserveError,
    InvalidBody,
    InvalidImage,
    InvalidParameter,
    InvalidText,
    ModelNotFound,
    TextTooLong,
    TooManyItems,
)
from clipserve.protocol import openai as codec

PNG = b"\x89PNG\r\n\x1a\n" + b"rest of a png"
JPEG = b"\xff\xd8\xff\xe0" + b"rest of a jpeg"
WEBP = b"RIFF\x10\x00\x00\x00WEBPVP8 "
MODELS = ["tiny/sha256:abc", "tiny"]


def parse(doc: Any, **kw: Any) -> codec.EmbeddingsRequest:
    limits = {"models": MODELS, "embed_dim": 32, "max_items": 4, "max_text_chars": 20} | kw
    return codec.parse_embeddings_request(orjson.dumps(doc), **limits)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_strings_are_split_into_texts_and_images_by_position() -> None:
    inputs = [codec.data_uri(PNG), "a cat", b64(JPEG), f"data:image/webp;base64,{b64(WEBP)}"]
    request = parse({"model": "tiny", "input": inputs})
    assert request.texts == ["a cat"] and request.text_index == [1]
    assert request.images == [PNG, JPEG, WEBP] and request.image_index == [0, 2, 3]
    assert request.protocol == "openai-mixed" and request.count == 4
    assert parse({"input": "a cat"}).protocol == "openai-text"
    assert parse({"input": b64(PNG)}).protocol == "openai-image"


def test_modality_and_truncate_decide_for_the_whole_request() -> None:
    url, uri = "http://x.org/c.jpg", codec.data_uri(PNG)
    as_text = parse({"input": [url, uri], "modality": "TEXT"}, max_text_chars=100)
    assert as_text.texts == [url, uri] and not as_text.images
    assert parse({"input": [uri], "modality": "image"}).images == [PNG]
    # A URL with words after it is a caption; "truncate" overrides the server's default.
    assert parse({"input": url + " is down"}, max_text_chars=40).texts == [url + " is down"]
    assert parse({"input": "a"}).truncate is False and parse({"input": "a"}, truncate=True).truncate
    assert parse({"input": "a", "truncate": "end"}).truncate is True
    assert parse({"input": "a", "truncate": "NONE"}, truncate=True).truncate is False
    assert parse({"input": "b" * 30, "truncate": "END"}).texts == ["b" * 20]  # --max-text-chars


def test_text_that_merely_looks_like_base64_stays_text() -> None:
    # Valid base64, but not the start of a JPEG/PNG/WebP file: a caption, not an image.
    assert parse({"input": ["dogs", "QUJD"]}).texts == ["dogs", "QUJD"]
    # "data:" then a blank before any ',': a caption, not a data URI.
    captions = ["Data: sales, 2023", "data: none", "DATA:image of a cat"]
    assert parse({"input": captions}).texts == captions


def test_model_defaults_and_options() -> None:
    request = parse({"input": "a"})
    assert request.model == MODELS[0] and request.encoding_format == "float"
    assert (
        parse({"input": "a", "encoding_format": "base64", "user": "u"}).encoding_format == "base64"
    )
    assert parse({"input": "a", "dimensions": 32}).texts == ["a"]  # the model's own size is fine


@pytest.mark.parametrize(
    ("doc", "kw", "error", "code", "message"),
    [
        (
            {"model": "gpt", "input": "a"},
            {},
            ModelNotFound,
            "model_not_found",
            "'gpt' does not exist",
        ),
        ({"model": 3, "input": "a"}, {}, InvalidParameter, "invalid_model", "must be a string"),
        (
            {"input": "a", "dimensions": 16},
            {},
            InvalidParameter,
            "invalid_dimensions",
            "fixed size of 32",
        ),
        ({"input": "a", "dimensions": True}, {}, InvalidParameter, "invalid_dimensions", "True"),
        (
            {"input": "a", "encoding_format": "int8"},
            {},
            InvalidParameter,
            "invalid_encoding_format",
            "'int8' is not supported",
        ),
        ({"input": "a", "user": 5}, {}, InvalidParameter, "invalid_user", "must be a string"),
        ({}, {}, InvalidParameter, "invalid_input", 'needs "input"'),
        ({"input": {"a": 1}}, {}, InvalidParameter, "invalid_input", "a string or a list"),
        ({"input": []}, {}, InvalidText, "invalid_text", '"input" is empty'),
        ({"input": ["a", ""]}, {}, InvalidText, "invalid_text", "item 1: empty string"),
        ({"input": [1, 2, 3]}, {}, InvalidParameter, "invalid_input", "token arrays"),
        ({"input": [[1, 2], [3]]}, {}, InvalidParameter, "invalid_input", "token arrays"),
        (
            {"input": ["a", None]},
            {},
            InvalidParameter,
            "invalid_input",
            "item 1: expected a string",
        ),
        ({"input": ["a"] * 5}, {}, TooManyItems, "too_many_items", "5 inputs in one request"),
        ({"input": ["a", "b" * 21]}, {}, TextTooLong, "text_too_long", "item 1: 21 characters"),
        (
            {"input": ["data:text/plain;base64,aGk="]},
            {},
            InvalidImage,
            "invalid_image",
            "item 0: data URI of type text/plain",
        ),
        (
            {"input": ["data:image/png,rawbytes"]},
            {},
            InvalidImage,
            "invalid_image",
            "must be base64",
        ),
        (
            {"input": ["a", "data:image/png;base64"]},
            {},
            InvalidImage,
            "invalid_image",
            "item 1: data URI without a ','",
        ),
        ({"input": ["/9j/not*base64"]}, {}, InvalidImage, "invalid_image", "not valid base64"),
        ([1], {}, InvalidBody, "invalid_body", "JSON object"),
        (
            {"input": ["a", "https://x.org/c.jpg"]},
            {},
            InvalidImage,
            "image_url_not_fetched",
            "item 1",
        ),
        ({"input": "a", "modality": "audio"}, {}, InvalidParameter, "invalid_modality", "'text'"),
        ({"input": "a", "modality": 1}, {}, InvalidParameter, "invalid_modality", "not served"),
        ({"input": "a", "modality": "image"}, {}, InvalidImage, "invalid_image", "not an image"),
        ({"input": "a", "truncate": "START"}, {}, InvalidParameter, "invalid_truncate", "'END'"),
        ({"input": "a", "truncate": True}, {}, InvalidParameter, "invalid_truncate", "'NONE'"),
    ],
)
def test_invalid_requests(
    doc: Any, kw: dict[str, Any], error: type[ClipserveError], code: str, message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        parse(doc, **kw)
    assert info.value.code == code


def test_item_count_is_checked_before_any_image_is_decoded() -> None:
    # Five items, the last an image that would fail to decode: the count is reported.
    inputs = ["a"] * 4 + ["/9j/!!!"]
    with pytest.raises(TooManyItems):
        parse({"input": inputs})


def test_malformed_json() -> None:
    with pytest.raises(InvalidBody, match="malformed JSON"):
        codec.parse_embeddings_request(
            b"{", models=MODELS, embed_dim=32, max_items=4, max_text_chars=20
        )


def test_merge_puts_rows_back_in_input_order() -> None:
    texts, images = np.array([[1.0, 1.0]]), np.array([[0.0, 2.0], [3.0, 0.0]])
    merged = codec.merge(3, [([1], texts), ([0, 2], images)])
    np.testing.assert_array_equal(merged, [[0, 2], [1, 1], [3, 0]])
    assert merged.dtype == np.float32


def test_response_validates_as_openai_type() -> None:
    embeddings = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    body = codec.encode_embeddings_response(
        embeddings, model="tiny", encoding_format="float", prompt_tokens=9
    )
    response = CreateEmbeddingResponse.model_validate_json(body)
    assert response.model == "tiny" and response.usage.total_tokens == 9
    assert [d.index for d in response.data] == [0, 1]
    np.testing.assert_array_equal(
        np.asarray([d.embedding for d in response.data], np.float32), embeddings
    )


def test_base64_response_is_little_endian_float32() -> None:
    embeddings = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    body = codec.encode_embeddings_response(
        embeddings, model="tiny", encoding_format="base64", prompt_tokens=9
    )
    data = orjson.loads(body)["data"]
    for row, item in zip(embeddings, data, strict=True):
        np.testing.assert_array_equal(
            np.frombuffer(base64.b64decode(item["embedding"]), "<f4"), row
        )


def test_models_and_errors_in_openai_shape() -> None:
    listed = orjson.loads(codec.encode_models(MODELS, 0))
    assert [Model.model_validate(m).id for m in listed["data"]] == MODELS
    error = orjson.loads(codec.encode_error("bad", 400, "invalid_dimensions"))["error"]
    assert error == {
        "message": "bad",
        "type": "invalid_request_error",
        "param": "dimensions",
        "code": "invalid_dimensions",
    }
    assert orjson.loads(codec.encode_error("x", 503, "overloaded"))["error"]["type"] == (
        "server_error"
    )


def test_build_request_round_trips() -> None:
    body = codec.build_embeddings_request(["a cat", PNG, JPEG], "tiny")
    request = codec.parse_embeddings_request(
        body, models=MODELS, embed_dim=32, max_items=4, max_text_chars=20
    )
    assert request.texts == ["a cat"] and request.images == [PNG, JPEG]
    assert codec.data_uri(WEBP).startswith("data:image/webp;base64,")


def test_value_floods_are_refused_before_parsing() -> None:
    import tracemalloc

    flood = b'{"input": [' + b"[]," * 1_000_000 + b'"a"]}'
    tracemalloc.start()
    try:
        with pytest.raises(TooManyItems):
            codec.parse_embeddings_request(
                flood, models=["m"], embed_dim=32, max_items=8, max_text_chars=100
            )
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()
