"""Clients migrating from Triton, NIM and Infinity need no code changes: their own model and
output names after one flag, the paths they already call, and a clear 400 where they would
otherwise get a silently wrong answer (an image URL embedded as text). Real servers, real
`openai` and `tritonclient` clients."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from clipserve.protocol import kserve
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    bytes_input,
    embed_image,
    embed_text,
    make_config,
    png_bytes,
    random_pixels,
    running,
)

URL = "https://example.com/cat.jpg"
LONG = "a photo of " + "a very " * 60 + "small cat"  # ~130 tokens, ~430 characters


@pytest.fixture(scope="module")
def named(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[RunningServer]:
    """One server with the names a team migrating from NIM and Triton brings along."""
    config = make_config(
        tiny_config,
        tiny_checkpoint,
        served_model_name=["nvidia/nvclip", "clip"],
        output_name="OUTPUT__0",
    )
    with running(config) as server:
        yield server


@pytest.fixture(scope="module")
def client(named: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=named.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def data_uri(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_openai_client_uses_its_own_model_name(named: RunningServer, client: openai.OpenAI) -> None:
    image = png_bytes(random_pixels(1))
    r = client.embeddings.create(model="nvidia/nvclip", input=["a cat", data_uri(image)])
    assert r.model == "nvidia/nvclip"
    got = np.array([d.embedding for d in r.data], np.float32)
    np.testing.assert_allclose(got[0], embed_text(named, ["a cat"])[0], atol=1e-5)
    np.testing.assert_allclose(got[1], embed_image(named, image), atol=1e-5)
    assert [m.id for m in client.models.list()] == ["nvidia/nvclip", "clip"]
    assert client.models.retrieve("nvidia/nvclip").id == "nvidia/nvclip"
    # The defaults are replaced, not added to: one list of names, the same on every door.
    with pytest.raises(openai.NotFoundError, match="nvidia/nvclip, clip"):
        client.embeddings.create(model="tiny-clip", input="a cat")
    assert httpx.get(named.url + "/info").json()["names"] == {
        "served_model_names": ["nvidia/nvclip", "clip"],
        "served_text_model_names": ["nvidia/nvclip-text", "clip-text"],
        "openai_models": ["nvidia/nvclip", "clip"],
        "kserve_output": "OUTPUT__0",
    }


KINDS = ("bytes", "uint8", "fp32", "fp16")  # the per-kind models (perf_analyzer's)


def test_triton_client_uses_its_own_model_and_output_names(named: RunningServer) -> None:
    image = png_bytes(random_pixels(2))
    tc = triton.InferenceServerClient(named.url.removeprefix("http://"))
    try:
        index = tc.get_model_repository_index()
        assert [(m["name"], m["state"]) for m in index] == [
            ("nvidia/nvclip", "READY"),
            ("clip", "READY"),
            ("nvidia/nvclip-text", "READY"),
            ("clip-text", "READY"),
            *((f"{name}-{kind}", "READY") for name in ("nvidia/nvclip", "clip") for kind in KINDS),
        ]
        meta = tc.get_model_metadata("clip")
        assert [o["name"] for o in meta["outputs"]] == ["OUTPUT__0", "OUTPUT__0_fp16"]
        # The input's name is the client's own; slashes in a model name pass as they are.
        inp = bytes_input([image], binary=True, name="INPUT__0")
        for model in ("clip", "nvidia/nvclip"):
            out = tc.infer(model, [inp], outputs=[triton.InferRequestedOutput("OUTPUT__0")])
            np.testing.assert_allclose(
                out.as_numpy("OUTPUT__0")[0], embed_image(named, image), atol=1e-5
            )
        assert tc.is_model_ready("nvidia/nvclip-text")
        texts = bytes_input([b"a cat"], binary=True, name="TEXT")
        out = tc.infer("clip-text", [texts])
        np.testing.assert_allclose(
            out.as_numpy("OUTPUT__0"), embed_text(named, ["a cat"]), atol=1e-5
        )
        with pytest.raises(InferenceServerException, match="outputs are OUTPUT__0, OUTPUT__0_fp16"):
            tc.infer("clip", [inp], outputs=[triton.InferRequestedOutput("embedding")])
        with pytest.raises(InferenceServerException) as info:
            tc.get_model_metadata("tiny-clip")
        assert info.value.status() == "404"
    finally:
        tc.close()


def test_image_urls_are_refused_on_every_door(named: RunningServer, client: openai.OpenAI) -> None:
    """Not fetched, never embedded as text: 400 `image_url_not_fetched`, in each door's shape."""
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="clip", input=["a cat", URL])
    assert error.value.code == "image_url_not_fetched" and "item 1" in str(error.value)
    with pytest.raises(openai.BadRequestError, match="URLs are not fetched") as error:
        client.embeddings.create(model="clip", input=URL, extra_body={"modality": "image"})
    assert error.value.code == "image_url_not_fetched"
    answers = {
        "raw": httpx.post(named.url + "/embed", content=URL.encode(), headers=PNG),
        "json": httpx.post(named.url + "/embed", json={"images": [URL]}),
        "multipart": httpx.post(
            named.url + "/embed", files=[("image", ("a.png", URL.encode(), "image/png"))]
        ),
    }
    for name, r in answers.items():
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["code"] == "image_url_not_fetched", name
        assert "not fetched" in r.json()["error"]["message"]
    tc = triton.InferenceServerClient(named.url.removeprefix("http://"))
    try:
        for binary in (True, False):
            with pytest.raises(InferenceServerException, match="URLs are not fetched") as e:
                tc.infer("clip", [bytes_input([URL.encode()], binary=binary)])
            assert e.value.status() == "400"
    finally:
        tc.close()
    # A caption that starts with a URL is a caption.
    r = client.embeddings.create(model="clip", input=URL + " is down again")
    assert len(r.data[0].embedding) == 32


def test_modality_says_what_every_input_is(named: RunningServer, client: openai.OpenAI) -> None:
    """Infinity's `modality`: "text" embeds even a data URI or a URL as text; "image" refuses
    text; anything else is a 400 naming the field."""
    tiny_uri = "data:image/png;base64,iVBORw0KGgo="
    r = client.embeddings.create(
        model="clip", input=[tiny_uri, URL], extra_body={"modality": "text"}
    )
    got = np.array([d.embedding for d in r.data], np.float32)
    np.testing.assert_allclose(got, embed_text(named, [tiny_uri, URL]), atol=1e-5)
    image = png_bytes(random_pixels(3))
    r = client.embeddings.create(
        model="clip", input=data_uri(image), extra_body={"modality": "image"}
    )
    np.testing.assert_allclose(r.data[0].embedding, embed_image(named, image), atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="not an image") as error:
        client.embeddings.create(model="clip", input="a cat", extra_body={"modality": "image"})
    assert error.value.code == "invalid_image"
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="clip", input="a cat", extra_body={"modality": "audio"})
    assert error.value.code == "invalid_modality" and error.value.param == "modality"  # type: ignore[attr-defined]


def test_infinity_and_nim_paths_answer(named: RunningServer) -> None:
    with openai.OpenAI(base_url=named.url, api_key="unused", max_retries=0) as infinity:
        r = infinity.embeddings.create(model="clip", input="a cat")  # POST /embeddings
        np.testing.assert_allclose(r.data[0].embedding, embed_text(named, ["a cat"])[0], atol=1e-5)
        assert [m.id for m in infinity.models.list()] == ["nvidia/nvclip", "clip"]
        with pytest.raises(openai.NotFoundError):  # errors in OpenAI's shape there too
            infinity.embeddings.create(model="nope", input="a cat")
    health = httpx.get(named.url + "/health")
    assert health.status_code == 200 and isinstance(health.json()["unix"], float)
    for path, message in (("/v1/health/ready", "ready"), ("/v1/health/live", "live")):
        r = httpx.get(named.url + path)
        assert r.status_code == 200 and message in r.json()["message"], path
    metrics = httpx.get(named.url + "/v1/metrics")
    assert metrics.status_code == 200 and "clipserve_requests_total" in metrics.text


def test_texts_over_the_context_are_refused_or_truncated(serve: Serve) -> None:
    """Default: a text over 77 tokens is a 400 naming it (OpenAI's rule); `"truncate": "END"`
    per request, or --truncate-text for the server, cuts it as open_clip does. The usage counts
    the tokens the model read."""
    strict = serve(max_items_per_request=8)
    with openai.OpenAI(base_url=strict.url + "/v1", api_key="unused", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError, match="item 1: over the model's context"):
            c.embeddings.create(model="tiny-clip", input=["a cat", LONG])
        r = c.embeddings.create(
            model="tiny-clip", input=["a cat", LONG], extra_body={"truncate": "END"}
        )
        assert r.usage.prompt_tokens == 4 + 77  # <start> a cat <end>; the cut text fills 77
        assert (
            c.embeddings.create(model="tiny-clip", input="!").usage.prompt_tokens == 3
        )  # "!" is token id 0
        with pytest.raises(openai.BadRequestError, match="'NONE'"):
            c.embeddings.create(model="tiny-clip", input="a cat", extra_body={"truncate": "START"})
    r = httpx.post(strict.url + "/embed/text", json={"texts": [LONG]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "text_too_long"

    lenient = serve(truncate_text="true", max_text_chars=200)
    cut = embed_text(lenient, [LONG])  # over the token context and over --max-text-chars
    np.testing.assert_allclose(cut, embed_text(lenient, [LONG[:200]]), atol=1e-6)
    body, headers = kserve.build_infer_request(texts=[LONG])
    r = httpx.post(f"{lenient.url}/v2/models/tiny-clip-text/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
