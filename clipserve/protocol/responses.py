"""Embeddings → response bytes: JSON, msgpack (dtype, shape, bytes) or raw little-endian floats."""

from __future__ import annotations

from collections.abc import Mapping

import msgpack
import numpy as np
import orjson

from clipserve.errors import InvalidParameter
from clipserve.protocol.media import JSON

MSGPACK = "application/msgpack"
RAW = "application/octet-stream"
RESPONSE_TYPES = (JSON, MSGPACK, RAW)
OUT_DTYPES = {"float32": "<f4", "float16": "<f2"}


def out_dtype(raw: str | None) -> str:
    if raw is None:
        return "float32"
    if raw not in OUT_DTYPES:
        raise InvalidParameter(f"query parameter dtype={raw!r}: expected float32 or float16")
    return raw


def encode_embeddings(
    embeddings: np.ndarray,
    *,
    single: bool,
    meta: Mapping[str, object],
    media: str = JSON,
    dtype: str = "float32",
) -> tuple[bytes, dict[str, str]]:
    """Body and extra headers. Single-image requests answer `embedding`, lists `embeddings`."""
    values = embeddings.astype(OUT_DTYPES[dtype], copy=False)
    key = "embedding" if single else "embeddings"
    payload = values[0] if single else values
    dim = int(embeddings.shape[1])
    if media == RAW:
        shape = ",".join(map(str, payload.shape))
        headers = {
            "X-Embedding-Shape": shape,
            "X-Embedding-Dtype": dtype,
            "X-Model": str(meta.get("model", "")),
        }
        return payload.tobytes(), headers
    if media == MSGPACK:
        tensor = {"dtype": dtype, "shape": list(payload.shape), "data": payload.tobytes()}
        return msgpack.packb({key: tensor, **meta, "dim": dim}), {}
    body = {key: payload, **meta, "dim": dim}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), {}


def encode_error(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message}})
