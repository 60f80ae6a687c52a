"""Embeddings → response bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from clipserve.protocol.media import JSON

RESPONSE_TYPES = (JSON,)


def encode_embeddings(
    embeddings: np.ndarray, *, single: bool, meta: Mapping[str, Any], media: str = JSON
) -> bytes:
    body: dict[str, Any] = {"embedding": embeddings[0]} if single else {"embeddings": embeddings}
    body.update(meta)
    body["dim"] = int(embeddings.shape[1])
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_error(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message}})
