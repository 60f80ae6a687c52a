"""`/v1/embeddings` and `/v1/models` end to end with the real `openai` client against real uvicorn
and the tiny open_clip model; answers compared with /embed and /embed/text."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from clipserve.protocol.openai import build_embeddings_request, data_uri
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
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
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    # max_retries=0: the errors under test must reach the test, not be retried.
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def vectors(response: Any) -> np.ndarray:
    return np.asarray([d.embedding for d in response.data], np.float32)


def test_text_single_and_list_equal_embed_text(
    server: RunningServer, client: openai.OpenAI
) -> None:
    texts = ["a photo of a cat", "a dog on a skateboard"]
    expected = embed_text(server, texts)
    one = client.embeddings.create(model=model_name(server), input=texts[0])
    assert one.object == "list" and one.model == model_name(server)
    assert [d.index for d in one.data] == [0] and one.data[0].object == "embedding"
    np.testing.assert_allclose(vectors(one), expected[:1], atol=1e-6)
    many = client.embeddings.create(model=server.state.runtime.model.identity, input=texts)
    assert [d.index for d in many.data] == [0, 1]
    np.testing.assert_allclose(vectors(many), expected, atol=1e-6)
    # CLIP tokens, start and end included: "a photo of a cat" → 5 + 2.
    assert one.usage.prompt_tokens == one.usage.total_tokens == 7


def test_image_data_uri_equals_embed_and_open_clip(
    server: RunningServer, client: openai.OpenAI, tiny_model: Any
) -> None:
    pixels = random_pixels(3)
    image = png_bytes(pixels)
    r = client.embeddings.create(model=model_name(server), input=data_uri(image))
    got = vectors(r)[0]
    np.testing.assert_allclose(got, embed_image(server, image), atol=1e-6)
    np.testing.assert_allclose(got, reference_embedding(tiny_model, pixels), atol=1e-5)
    assert r.usage.prompt_tokens == 1  # an image counts as one
    # Bare base64 (no data: prefix) is an image too.
    bare = client.embeddings.create(
        model=model_name(server), input=base64.b64encode(image).decode()
    )
    np.testing.assert_allclose(vectors(bare)[0], got, atol=1e-6)


def test_mixed_list_is_answered_in_input_order(
    server: RunningServer, client: openai.OpenAI
) -> None:
    images = [png_bytes(random_pixels(s)) for s in (4, 5)]
    inputs = [data_uri(images[0]), "a cat", data_uri(images[1]), "a dog"]
    r = client.embeddings.create(model=model_name(server), input=inputs)
    got = vectors(r)
    assert [d.index for d in r.data] == [0, 1, 2, 3]
    texts = embed_text(server, ["a cat", "a dog"])
    np.testing.assert_allclose(got[[1, 3]], texts, atol=1e-6)
    np.testing.assert_allclose(got[0], embed_image(server, images[0]), atol=1e-6)
    np.testing.assert_allclose(got[2], embed_image(server, images[1]), atol=1e-6)
    assert r.usage.prompt_tokens == 2 + 4 + 4


def test_encoding_formats(server: RunningServer, client: openai.OpenAI) -> None:
    name = model_name(server)
    floats = client.embeddings.create(model=name, input="a cat", encoding_format="float")
    assert isinstance(floats.data[0].embedding, list)
    b64 = client.embeddings.create(model=name, input="a cat", encoding_format="base64")
    raw = b64.data[0].embedding  # asked for explicitly: the client leaves the string alone
    assert isinstance(raw, str)
    decoded = np.frombuffer(base64.b64decode(raw), "<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats.data[0].embedding, np.float32))
    # Unasked, the client requests base64 and decodes it itself: the same floats.
    default = client.embeddings.create(model=name, input="a cat")
    np.testing.assert_array_equal(vectors(default)[0], decoded)


def test_answers_carry_request_id_timing_and_protocol_metrics(
    server: RunningServer, client: openai.OpenAI
) -> None:
    raw = client.embeddings.with_raw_response.create(
        model=model_name(server),
        input=["a cat", data_uri(png_bytes(random_pixels(6)))],
        extra_headers={"X-Request-Id": "openai-42"},
    )
    assert raw.headers["x-request-id"] == "openai-42"
    stages = dict(re.findall(r"(\w+);dur=([0-9.]+)", raw.headers["server-timing"]))
    assert {"receive", "decode", "queue", "compute", "encode"} <= set(stages)
    assert len(raw.parse().data) == 2
    client.embeddings.create(model=model_name(server), input="text only")
    text = httpx.get(server.url + "/metrics").text
    for label in ("openai-mixed", "openai-text"):
        assert f'_count{{protocol="{label}",stage="compute"}}' in text
    assert 'route="/v1/embeddings"' in text


def test_models_lists_the_model_and_its_alias(server: RunningServer, client: openai.OpenAI) -> None:
    model = server.state.runtime.model
    ids = [m.id for m in client.models.list()]
    assert ids == [model.identity, model.name]
    assert client.models.retrieve(model.identity).id == model.identity
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize(
    ("kwargs", "error", "code", "param", "message"),
    [
        (
            {"model": "text-embedding-3-small", "input": "a cat"},
            openai.NotFoundError,
            "model_not_found",
            "model",
            "'text-embedding-3-small' does not exist",
        ),
        (
            {"input": "a cat", "dimensions": 16},
            openai.BadRequestError,
            "invalid_dimensions",
            "dimensions",
            "fixed size of 32",
        ),
        ({"input": ""}, openai.BadRequestError, "invalid_text", "input", "item 0: empty string"),
        ({"input": []}, openai.BadRequestError, "invalid_text", "input", '"input" is empty'),
        (
            {"input": ["a"] * 9},
            openai.BadRequestError,
            "too_many_items",
            "input",
            "9 inputs in one request; the limit is 8",
        ),
        (
            {"input": "x" * 1001},
            openai.BadRequestError,
            "text_too_long",
            "input",
            "1001 characters; the limit is 1000",
        ),
        # Undecodable, found in the decode pool: the index is still the item's place in "input".
        (
            {"input": ["a cat", data_uri(b"\x89PNG\r\n\x1a\nbroken")]},
            openai.BadRequestError,
            "invalid_image",
            "input",
            "item 1: ",
        ),
        (
            {"input": ["a cat", "data:image/png;base64,%%%"]},
            openai.BadRequestError,
            "invalid_image",
            "input",
            "item 1: image is not valid base64",
        ),
        (
            {"input": [[1, 2, 3]]},
            openai.BadRequestError,
            "invalid_input",
            "input",
            "token arrays are not supported",
        ),
    ],
)
def test_errors_reach_the_client_as_its_own_exceptions(
    server: RunningServer,
    client: openai.OpenAI,
    kwargs: dict[str, Any],
    error: type[openai.APIStatusError],
    code: str,
    param: str,
    message: str,
) -> None:
    kwargs.setdefault("model", model_name(server))
    with pytest.raises(error) as info:
        client.embeddings.create(**kwargs)
    assert info.value.code == code and info.value.param == param
    assert info.value.type == "invalid_request_error"
    assert message in info.value.message
    assert info.value.response.headers["x-request-id"]


def test_wire_level_shapes(server: RunningServer) -> None:
    """What other clients see: plain JSON, unknown /v1 paths in OpenAI's error shape."""
    body = build_embeddings_request(["a cat", png_bytes(random_pixels(2))], model_name(server))
    r = httpx.post(
        server.url + "/v1/embeddings",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "list" and len(doc["data"][1]["embedding"]) == 32
    missing = httpx.get(server.url + "/v1/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    bad = httpx.post(server.url + "/v1/embeddings", content=b"{", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_body"
    # No door decompresses: a compressed body is refused before it is read, in OpenAI's shape.
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    zipped = httpx.post(server.url + "/v1/embeddings", content=body, headers=headers, timeout=30)
    assert zipped.status_code == 415, zipped.text
    assert zipped.json()["error"]["type"] == "invalid_request_error"
    assert "Content-Encoding gzip" in zipped.json()["error"]["message"]
    headers["Content-Encoding"] = "identity"
    plain = httpx.post(server.url + "/v1/embeddings", content=body, headers=headers, timeout=30)
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/embeddings", {"POST"}),
        ("HEAD", "/v1/embeddings", {"POST"}),
        ("GET", "/embeddings", {"POST"}),  # Infinity's path
        ("POST", "/v1/models", {"GET", "HEAD"}),
        ("DELETE", "/v1/models/{m}", {"GET", "HEAD"}),
    ],
)
def test_a_method_a_route_does_not_take_is_405_in_openais_shape(
    server: RunningServer, method: str, path: str, allow: set[str]
) -> None:
    r = httpx.request(method, server.url + path.format(m=model_name(server)), timeout=30)
    assert r.status_code == 405, r.text
    assert {m.strip() for m in r.headers["allow"].split(",")} == allow
    if method != "HEAD":
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "method_not_allowed")


def test_overload_is_a_server_error_with_retry_after(serve: Serve) -> None:
    server = serve(
        backend="fake",
        backend_option=["latency_ms=1000"],
        max_batch_size=1,
        max_queue_size=1,
        max_items_per_request=1,
    )
    image = png_bytes(random_pixels(1))
    batcher = server.state.towers["image"]

    async def scenario() -> openai.APIStatusError:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as h,
            openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as client,
        ):
            first = asyncio.create_task(h.post("/embed", content=image, headers=PNG))
            await until_async(
                lambda: any(w.running for w in batcher.workers)
            )  # its slot is free again
            second = asyncio.create_task(h.post("/embed", content=image, headers=PNG))
            await until_async(lambda: batcher.admission.used == 1)  # queued: holds the only slot
            with pytest.raises(openai.InternalServerError) as info:
                await client.embeddings.create(model=model_name(server), input=data_uri(image))
            assert [(await r).status_code for r in (first, second)] == [200, 200]
            return info.value

    error = asyncio.run(scenario())
    assert error.status_code == 503 and error.code == "overloaded"
    assert error.type == "server_error" and "retry later" in error.message
    assert int(error.response.headers["retry-after"]) >= 1
