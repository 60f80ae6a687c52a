"""OpenAI's embeddings API (`POST /v1/embeddings`): request bodies → texts and encoded images,
embeddings → the response body. Pure: bytes in, bytes out; no Starlette.

`input` is a string or a list of strings. Without `modality`, a string is an image when it is a
`data:image/...;base64,` URI or bare base64 of a JPEG, PNG or WebP file (the convention Infinity
and vLLM use for CLIP), an image URL when it is one http(s) URL (fetched where
--allow-url-fetch allows, else refused: never embedded as text), and text otherwise.
Infinity's `modality` says it for the whole request: "text" (every string is text, data URIs
and URLs included) or "image" (every string must be an image). Token arrays (lists of ints)
are refused: they would be another tokenizer's ids, meaningless to CLIP's.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from clipserve.errors import (
    InvalidBody,
    InvalidImage,
    InvalidParameter,
    InvalidText,
    ModelNotFound,
    TooManyItems,
    with_item_index,
)
from clipserve.protocol.requests import loads_json
from clipserve.protocol.text import check_length
from clipserve.protocol.urls import is_url, url_refused

ENCODING_FORMATS = ("float", "base64")
# Base64 of the first bytes of each format the decoder reads: JPEG FF D8 FF, PNG 89 50 4E 47 0D 0A
# 1A 0A, WebP "RIFF". A text that starts like this and is valid base64 is not a caption.
IMAGE_B64_PREFIXES = ("/9j/", "iVBORw0KGg", "UklGR")


FIELDS = ("input", "model", "encoding_format", "dimensions", "user", "modality", "truncate")
MODALITIES = ("text", "image")  # Infinity's; its "audio" is not served
# NIM's `truncate`: "NONE" refuses a text over the context, "END" cuts its end off. "START"
# (keep the end) is not offered: CLIP's end token carries the text's embedding.
TRUNCATE = {"NONE": False, "END": True}
# Codes of the errors that point at `input`.
INPUT_CODES = (
    "invalid_text",
    "text_too_long",
    "too_many_items",
    "too_many_texts",
    "invalid_image",
    "image_too_large",
    "image_url_not_fetched",
    "image_url_refused",
    "image_fetch_failed",
)
# Which request field an error's code points at, for the `param` of OpenAI's error body.
PARAM_OF_CODE = {
    "model_not_found": "model",
    **{code: "input" for code in INPUT_CODES},
    **{f"invalid_{name}": name for name in FIELDS},
}


class InvalidField(InvalidParameter):
    """A request field with a bad value; the code (`invalid_<field>`) names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.code = f"invalid_{param}"


@dataclass
class EmbeddingsRequest:
    """One request's inputs split by tower, each remembering its position in `input`."""

    model: str
    encoding_format: str
    count: int
    truncate: bool
    texts: list[str] = field(default_factory=list)
    text_index: list[int] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)
    image_index: list[int] = field(default_factory=list)
    urls: dict[int, str] = field(default_factory=dict)  # images[i] is fetched from urls[i]

    @property
    def protocol(self) -> str:
        """Metrics label: openai-text, openai-image, or openai-mixed."""
        if self.texts and self.images:
            return "openai-mixed"
        return "openai-image" if self.images else "openai-text"


def _decode_b64(data: str, index: int) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidImage(f"item {index}: image is not valid base64") from None


def _image_of(item: str, index: int, fetch_urls: bool) -> bytes | str | None:
    """The encoded image a string carries, its URL (to fetch), or None if it is text."""
    if is_url(item):
        if fetch_urls:
            return item
        raise with_item_index(url_refused(), index)
    if item[:5].lower() == "data:":  # else no scan of the text for a comma
        head, sep, data = item.partition(",")
        # A URI's head has no blank ("data: none", "Data: sales by region, 2023" are captions).
        if len(head.split(maxsplit=1)) == 1:
            if not sep:
                raise InvalidImage(f"item {index}: data URI without a ',' before its data")
            params = head[5:].split(";")
            if not params[0].lower().startswith("image/"):
                kind = params[0] or "(none)"
                raise InvalidImage(
                    f"item {index}: data URI of type {kind}; only image/* is embedded"
                )
            if "base64" not in (p.strip().lower() for p in params[1:]):
                raise InvalidImage(f"item {index}: an image data URI must be base64 (';base64,')")
            return _decode_b64(data, index)
    if item.startswith(IMAGE_B64_PREFIXES):
        return _decode_b64(item, index)
    return None


def _model(doc: dict[str, Any], models: Collection[str]) -> str:
    model = doc.get("model")
    if model is None:  # OpenAI requires it; one model is served, so its absence is unambiguous
        return next(iter(models))
    if not isinstance(model, str):
        raise InvalidField('"model" must be a string', "model")
    if model not in models:
        raise ModelNotFound(
            f"The model {model!r} does not exist; this server serves {', '.join(models)}"
        )
    return model


def _options(doc: dict[str, Any], embed_dim: int) -> str:
    encoding = doc.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise InvalidField(
            f"encoding_format {encoding!r} is not supported; use 'float' or 'base64'",
            "encoding_format",
        )
    dimensions = doc.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions != embed_dim
    ):
        raise InvalidField(
            f"dimensions={dimensions!r} is not supported: CLIP embeddings have a fixed size of "
            f"{embed_dim}; omit dimensions (or pass {embed_dim})",
            "dimensions",
        )
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidField('"user" must be a string', "user")
    return str(encoding)


def _modality(doc: dict[str, Any]) -> str | None:
    modality = doc.get("modality")
    if modality is None:
        return None
    if not isinstance(modality, str) or modality.lower() not in MODALITIES:
        raise InvalidField(
            f"modality {str(modality)[:40]!r} is not served; use 'text' or 'image' (or leave it "
            "out: data URIs and base64 images are images, other strings text)",
            "modality",
        )
    return modality.lower()


def _truncate(doc: dict[str, Any], default: bool) -> bool:
    truncate = doc.get("truncate")
    if truncate is None:
        return default
    if not isinstance(truncate, str) or truncate.upper() not in TRUNCATE:
        raise InvalidField(
            f"truncate {str(truncate)[:40]!r} is not supported; use 'NONE' (refuse a text over "
            "the model's context) or 'END' (cut it to fit)",
            "truncate",
        )
    return TRUNCATE[truncate.upper()]


def _inputs(doc: dict[str, Any], max_items: int) -> list[str]:
    if "input" not in doc:
        raise InvalidField('the body needs "input": a string or a list of strings', "input")
    raw = doc["input"]
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise InvalidField('"input" must be a string or a list of strings', "input")
    if not items:
        raise InvalidText('"input" is empty')
    if len(items) > max_items:  # before looking at any item
        raise TooManyItems(
            f"{len(items)} inputs in one request; the limit is {max_items} "
            "(--max-items-per-request)"
        )
    for index, item in enumerate(items):
        if isinstance(item, str):
            continue
        if isinstance(item, int | list) and not isinstance(item, bool):
            raise InvalidField(
                "token arrays are not supported: CLIP has its own tokenizer; send strings",
                "input",
            )
        raise InvalidField(f"item {index}: expected a string, got {type(item).__name__}", "input")
    return items


def parse_embeddings_request(
    body: bytes,
    *,
    models: Sequence[str],
    embed_dim: int,
    max_items: int,
    max_text_chars: int,
    truncate: bool = False,
    fetch_urls: bool = False,
) -> EmbeddingsRequest:
    """Validate a request body; `models` are the names the served model answers to, the first
    being the one a request without `model` gets; `truncate` is the server's default for a
    request without "truncate"; with `fetch_urls` an http(s) URL is an image to fetch. Counts
    and lengths are checked before any base64 is decoded."""
    doc = loads_json(body, max_items)  # counts values before building any
    if not isinstance(doc, dict):
        raise InvalidBody("the body must be a JSON object")
    model = _model(doc, models)
    encoding = _options(doc, embed_dim)
    modality = _modality(doc)
    truncate = _truncate(doc, truncate)
    items = _inputs(doc, max_items)
    request = EmbeddingsRequest(model, encoding, len(items), truncate)
    for index, item in enumerate(items):
        image = None if modality == "text" else _image_of(item, index, fetch_urls)
        if isinstance(image, str):
            request.urls[len(request.images)] = image
            image = b""
        if image is not None:
            request.images.append(image)
            request.image_index.append(index)
            continue
        if modality == "image":
            raise InvalidImage(
                f"item {index}: not an image, and modality is 'image': send a "
                "data:image/...;base64, URI or base64 of a JPEG, PNG or WebP file"
            )
        if not item:
            raise InvalidText(f"item {index}: empty string")
        request.texts.append(check_length(item, index, max_text_chars, truncate))
        request.text_index.append(index)
    return request


def merge(count: int, parts: Sequence[tuple[Sequence[int], np.ndarray]]) -> np.ndarray:
    """Rows of each tower's (n, D) answer put back at their positions in `input`."""
    dim = next(int(e.shape[1]) for _, e in parts if len(e))
    out = np.empty((count, dim), np.float32)
    for index, embeddings in parts:
        if len(index):
            out[np.asarray(index)] = embeddings
    return out


def encode_embeddings_response(
    embeddings: np.ndarray, *, model: str, encoding_format: str, prompt_tokens: int
) -> bytes:
    """OpenAI's `{"object": "list", "data": [...], "model", "usage"}`; base64 is the float32
    little-endian bytes of each embedding, which the openai client decodes with numpy."""
    values = embeddings.astype("<f4", copy=False)
    data: list[dict[str, Any]] = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(row.tobytes()).decode("ascii")
            if encoding_format == "base64"
            else row,
        }
        for i, row in enumerate(values)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_models(models: Sequence[str], created: int) -> bytes:
    """`GET /v1/models`: every name the served model answers to."""
    data = [_model_object(m, created) for m in models]
    return orjson.dumps({"object": "list", "data": data})


def encode_model(model: str, created: int) -> bytes:
    return orjson.dumps(_model_object(model, created))


def _model_object(model: str, created: int) -> dict[str, str | int]:
    return {"id": model, "object": "model", "created": created, "owned_by": "clipserve"}


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def encode_error(message: str, status: int, code: str) -> bytes:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    error = {
        "message": message,
        "type": error_type(status),
        "param": PARAM_OF_CODE.get(code),
        "code": code,
    }
    return orjson.dumps({"error": error})


def data_uri(image: bytes) -> str:
    """An encoded image as a data URI, its media type read from its first bytes."""
    kind = "png" if image.startswith(b"\x89PNG") else "webp" if image[8:12] == b"WEBP" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(image).decode("ascii")


def build_embeddings_request(
    inputs: str | Sequence[str | bytes], model: str, encoding_format: str = "float"
) -> bytes:
    """A request body, for load generators and tests: `bytes` items are encoded images, sent as
    data URIs; strings are sent as they are."""
    items = inputs if isinstance(inputs, str) else [_as_input(i) for i in inputs]
    return orjson.dumps({"model": model, "input": items, "encoding_format": encoding_format})


def _as_input(item: str | bytes) -> str:
    return data_uri(item) if isinstance(item, bytes) else item
