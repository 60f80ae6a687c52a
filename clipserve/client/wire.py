"""The service's wire formats, as the client speaks them: msgpack request bodies for /embed and
/embed/text, msgpack embedding answers, and error answers read back into a code, a message and
the item they blame. Pure: bytes in, arrays and tuples out."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import orjson

MSGPACK = "application/msgpack"
HEADERS = {"Content-Type": MSGPACK, "Accept": MSGPACK}
# Bytes a msgpack body adds around its items: the map, keys, a tensor's dtype and shape.
ENVELOPE_BYTES = 128
BIN_HEADER_BYTES = 5  # bin 32: marker and length, per encoded image
_DTYPES = {"float32": "<f4", "float16": "<f2"}
_ITEM = re.compile(r"^item (\d+): (.*)$", re.S)


def images_body(images: Sequence[bytes]) -> bytes:
    """`{"images": [<bin>, ...]}`: encoded images, decoded by the server."""
    body: bytes = msgpack.packb({"images": list(images)}, use_bin_type=True)
    return body


def tensor_body(crops: Sequence[np.ndarray]) -> bytes:
    """`{"tensor": {...}}`: uint8 NHWC crops at the model's input size, normalised by the server."""
    batch = np.stack(crops)
    tensor = {"dtype": "uint8", "shape": list(batch.shape), "data": batch.tobytes()}
    body: bytes = msgpack.packb({"tensor": tensor}, use_bin_type=True)
    return body


def texts_body(texts: Sequence[str]) -> bytes:
    body: bytes = msgpack.packb({"texts": list(texts)}, use_bin_type=True)
    return body


def item_bytes(item: bytes | np.ndarray) -> int:
    """What one item adds to a body."""
    if isinstance(item, np.ndarray):
        return item.nbytes
    return len(item) + BIN_HEADER_BYTES


class BadAnswer(ValueError):
    """A 2xx answer that is not the embeddings asked for."""


def embeddings(body: bytes, n: int) -> np.ndarray:
    """float32 (n, D) from a msgpack answer `{"embeddings": {"dtype", "shape", "data"}, ...}`."""
    try:
        doc = msgpack.unpackb(body, raw=False)
        tensor = doc["embeddings"]
        dtype, shape, data = tensor["dtype"], tensor["shape"], tensor["data"]
        array = np.frombuffer(data, dtype=_DTYPES[dtype]).reshape(shape)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
        raise BadAnswer(f"unreadable embeddings answer ({type(e).__name__}: {e})") from None
    if array.ndim != 2 or array.shape[0] != n:
        raise BadAnswer(f"expected {n} embeddings, got shape {tuple(array.shape)}")
    return array.astype(np.float32)


@dataclass(frozen=True)
class Refusal:
    """An error answer: the status, the server's code and message, and the request item the
    message blames (`item N: ...`), with the message's rest as `reason`."""

    status: int
    code: str
    message: str
    item: int | None
    reason: str

    @classmethod
    def of(cls, status: int, body: bytes) -> Refusal:
        code, message = f"http_{status}", body[:300].decode("utf-8", "replace").strip()
        try:
            error = orjson.loads(body)["error"]
            code, message = str(error["code"]), str(error["message"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            pass
        item, reason = blamed_item(message)
        return cls(status, code, message, item, reason)


def blamed_item(message: str) -> tuple[int | None, str]:
    """(N, rest) for a message `item N: rest`, else (None, message): how the server and the
    local checks both name the bad item of a list."""
    found = _ITEM.match(message)
    return (None, message) if found is None else (int(found.group(1)), found.group(2))
