"""Request bodies → the items to embed. Pure: bytes, media types and headers in; no Starlette."""

from __future__ import annotations

import base64
import binascii
import functools
import re
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass, field
from typing import TypeVar

import msgpack
import numpy as np
import orjson

from clipserve.errors import (
    ClipserveError,
    InvalidBody,
    TooManyItems,
    UnsupportedMediaType,
    with_item_index,
)
from clipserve.protocol.media import JSON, media_type
from clipserve.protocol.multipart import parse_files
from clipserve.protocol.tensors import (
    TensorLayout,
    check_count,
    parse_shape,
    parse_tensor,
    tensor_layout,
    tensor_view,
)
from clipserve.protocol.urls import is_url, url_refused

IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp")
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
MULTIPART = "multipart/form-data"
RAW_TENSOR = "application/octet-stream"  # dtype and shape in X-Tensor-Dtype, X-Tensor-Shape
REQUEST_TYPES = (*IMAGE_TYPES, MULTIPART, *MSGPACK_TYPES, RAW_TENSOR, JSON)


@dataclass
class Payload:
    """Encoded images to decode, or one already-preprocessed tensor batch."""

    protocol: str  # metrics label: jpeg, png, webp, multipart, msgpack-images, ...
    images: list[bytes] = field(default_factory=list)
    tensor: np.ndarray | None = None
    single: bool = False  # answer {"embedding": ...} rather than {"embeddings": [...]}
    urls: dict[int, str] = field(default_factory=dict)  # images[i] is fetched from urls[i]

    def __len__(self) -> int:
        return len(self.images) if self.tensor is None else int(self.tensor.shape[0])


def protocol_label(media: str) -> str:
    return {"image/jpeg": "jpeg", "image/png": "png", "image/webp": "webp"}.get(media, "other")


def check_media_type(media: str, accepted: tuple[str, ...] = REQUEST_TYPES) -> None:
    """Refuse an unsupported Content-Type before reading the body."""
    if media not in accepted:
        shown = media or "(none)"
        raise UnsupportedMediaType(
            f"Content-Type {shown} is not supported; send one of {', '.join(accepted)}"
        )


def _count(n: int, max_items: int) -> None:
    check_count(n, max_items)
    if n == 0:
        raise InvalidBody("the request holds no images")


# Besides its items, a well-formed body holds a few values: keys, the tensor's dtype and shape.
ENVELOPE_VALUES = 32
# A token is a string or one of , : [ { outside strings; run of anything else first, possessive
# so a long run never backtracks.
_JSON_TOKEN = re.compile(rb'[^,:\[{"]*+(?:"[^"]*"|[,:\[{])')


def value_budget(max_items: int) -> int:
    """Most values (keys, items, scalars) a body may hold before it is parsed into objects:
    each costs 30-70 bytes as a Python object and as little as one byte on the wire."""
    return max_items + ENVELOPE_VALUES


def _too_many_values(kind: str, max_items: int, error: type[ClipserveError]) -> ClipserveError:
    return error(
        f"{kind} body holds more than {value_budget(max_items)} values; a request "
        f"holds at most {max_items} items (--max-items-per-request)"
    )


class _OverBudget(Exception):
    pass


SizedT = TypeVar("SizedT", bound=Sized)


def unpack_msgpack(
    body: bytes, max_items: int, error: type[ClipserveError] = TooManyItems
) -> object:
    """Unpack, refusing more than `value_budget(max_items)` values as they are built (msgpack
    otherwise turns a 32 MiB body of empty arrays into 32 M lists: gigabytes)."""
    budget = value_budget(max_items)
    built = 0

    def counted(container: SizedT, per_entry: int) -> SizedT:
        nonlocal built
        built += len(container) * per_entry + 1
        if built > budget:
            raise _OverBudget
        return container

    try:
        # No ext_hook: extension types stay opaque ExtType values, never objects.
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_array_len=budget,
            max_map_len=budget,
            list_hook=lambda c: counted(c, 1),
            object_hook=lambda c: counted(c, 2),
        )
    except _OverBudget:
        raise _too_many_values("msgpack", max_items, error) from None
    except ValueError as e:
        if "exceeds max_" in str(e):  # a declared array or map length over the budget
            raise _too_many_values("msgpack", max_items, error) from None
        raise InvalidBody(f"malformed msgpack body (ValueError: {e})") from None
    except Exception as e:
        raise InvalidBody(f"malformed msgpack body ({type(e).__name__}: {e})") from None


def loads_json(body: bytes, max_items: int, error: type[ClipserveError] = TooManyItems) -> object:
    """orjson.loads, after counting tokens up to the value budget without building anything
    (orjson turns a 32 MiB body of [] into 10 M lists). Stops at the budget or the first thing
    that is not a token, so the count costs O(budget) matches, whatever the body."""
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in body else body
    pos = tokens = 0
    while (token := _JSON_TOKEN.match(plain, pos)) is not None:
        tokens += 1
        if tokens > 2 * value_budget(max_items):  # an item is a string and a comma
            raise _too_many_values("JSON", max_items, error)
        pos = token.end()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidBody(f"malformed JSON body ({e})") from None


@dataclass(frozen=True)
class RequestBody:
    """A request body and what its codec may read besides it."""

    content_type: str
    headers: Mapping[str, str]  # lower-case names to values (X-Tensor-Dtype, X-Tensor-Shape)
    data: bytes
    size: tuple[int, int]  # the model's (height, width)
    max_items: int
    fetch_urls: bool = False  # --allow-url-fetch: a URL in JSON "images" is an image to fetch


def _one_image(r: RequestBody) -> Payload:
    return Payload(protocol_label(media_type(r.content_type)), images=[r.data], single=True)


def _multipart(r: RequestBody) -> Payload:
    return Payload("multipart", images=parse_files(r.content_type, r.data, r.max_items))


def _msgpack(r: RequestBody) -> Payload:
    doc = unpack_msgpack(r.data, r.max_items)
    if not isinstance(doc, dict) or len({"images", "tensor"} & doc.keys()) != 1:
        raise InvalidBody('msgpack body must be a map with "images" or "tensor"')
    if "images" in doc:
        images = doc["images"]
        if not isinstance(images, list):
            raise InvalidBody('"images" must be an array of binary values')
        _count(len(images), r.max_items)
        for index, item in enumerate(images):
            if not isinstance(item, bytes):
                got = type(item).__name__
                raise InvalidBody(f"item {index}: images must be msgpack bin, not {got}")
        return Payload("msgpack-images", images=images)
    spec = doc["tensor"]
    if not isinstance(spec, dict) or not {"dtype", "shape", "data"} <= spec.keys():
        raise InvalidBody('"tensor" must be a map with "dtype", "shape" and "data"')
    dtype, shape, data = spec["dtype"], spec["shape"], spec["data"]
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(data, bytes):
        raise InvalidBody('"tensor" needs dtype: str, shape: array, data: bin')
    tensor = parse_tensor(dtype, shape, data, r.size, r.max_items)
    return Payload("msgpack-tensor", tensor=tensor)


def _raw_tensor(r: RequestBody) -> Payload:
    dtype, shape = r.headers.get("x-tensor-dtype"), r.headers.get("x-tensor-shape")
    if dtype is None or shape is None:
        raise InvalidBody("application/octet-stream needs X-Tensor-Dtype and X-Tensor-Shape")
    layout = _header_layout(dtype, shape, r.size, r.max_items)
    return Payload("raw-tensor", tensor=tensor_view(layout, r.data))


@functools.lru_cache(maxsize=256)
def _header_layout(dtype: str, shape: str, size: tuple[int, int], max_items: int) -> TensorLayout:
    """The headers' layout, checked once per distinct pair: clients send the same few over
    and over. A refused pair raises, and is not cached."""
    return tensor_layout(dtype.strip().lower(), parse_shape(shape), size, max_items)


def _json(r: RequestBody) -> Payload:
    doc = loads_json(r.data, r.max_items)
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise InvalidBody('JSON body must be {"images": ["<base64>", ...]}')
    _count(len(doc["images"]), r.max_items)
    images = []
    urls: dict[int, str] = {}
    for index, item in enumerate(doc["images"]):
        if isinstance(item, str) and is_url(item):
            if not r.fetch_urls:
                raise with_item_index(url_refused(), index)
            urls[index] = item
            images.append(b"")
            continue
        try:
            images.append(base64.b64decode(item, validate=True))
        except (binascii.Error, TypeError, ValueError):
            raise InvalidBody(f"item {index}: not a base64 string") from None
    return Payload("json-urls" if urls else "json-base64", images=images, urls=urls)


@dataclass(frozen=True)
class ImageCodec:
    """How one request media type becomes a Payload."""

    read: Callable[[RequestBody], Payload]
    inline: bool = False  # one encoded image: nothing to parse, so no hop to the pool

    def parse(
        self,
        content_type: str,
        headers: Mapping[str, str],
        body: bytes,
        size: tuple[int, int],
        max_items: int,
        fetch_urls: bool = False,
    ) -> Payload:
        """`headers` maps lower-case names to values; `size` is the model's (height, width)."""
        return self.read(RequestBody(content_type, headers, body, size, max_items, fetch_urls))


CODECS: dict[str, ImageCodec] = {
    **{media: ImageCodec(_one_image, inline=True) for media in IMAGE_TYPES},
    MULTIPART: ImageCodec(_multipart),
    **{media: ImageCodec(_msgpack) for media in MSGPACK_TYPES},
    RAW_TENSOR: ImageCodec(_raw_tensor),
    JSON: ImageCodec(_json),
}
assert set(CODECS) == set(REQUEST_TYPES)


def image_codec(content_type: str | None) -> ImageCodec:
    """The codec for a request's Content-Type, chosen once, before the body is read."""
    media = media_type(content_type)
    check_media_type(media)
    return CODECS[media]


def parse_body(
    content_type: str,
    headers: Mapping[str, str],
    body: bytes,
    size: tuple[int, int],
    max_items: int,
) -> Payload:
    """`image_codec(content_type).parse(...)`, for callers that have the whole request at once."""
    return image_codec(content_type).parse(content_type, headers, body, size, max_items)
