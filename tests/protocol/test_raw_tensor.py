"""Raw tensor bodies (application/octet-stream with X-Tensor-Dtype and X-Tensor-Shape): the
headers' layout is checked once per distinct pair, the body's length every time."""

from __future__ import annotations

import numpy as np
import pytest

from clipserve.errors import InvalidTensor, TooManyItems
from clipserve.protocol.requests import RAW_TENSOR, image_codec

SIZE = (224, 224)
HEADERS = {"x-tensor-dtype": "uint8", "x-tensor-shape": "2,224,224,3"}


def parse(body: bytes, headers: dict[str, str], max_items: int = 8) -> np.ndarray:
    payload = image_codec(RAW_TENSOR).parse(RAW_TENSOR, headers, body, SIZE, max_items)
    assert payload.tensor is not None and payload.protocol == "raw-tensor"
    return payload.tensor


def test_the_tensor_is_a_view_of_the_body() -> None:
    body = np.arange(2 * 224 * 224 * 3, dtype=np.uint8).tobytes()
    tensor = parse(body, HEADERS)
    assert tensor.shape == (2, 224, 224, 3)
    assert np.shares_memory(tensor, np.frombuffer(body, np.uint8))
    assert tensor[1, 0, 0, 0] == (224 * 224 * 3) % 256


def test_known_headers_still_check_each_body_length() -> None:
    good = bytes(2 * 224 * 224 * 3)
    parse(good, HEADERS)
    with pytest.raises(InvalidTensor, match=r"shape \[2, 224, 224, 3\] of uint8 needs 301056"):
        parse(good[:-1], HEADERS)  # the same headers as a body that fit


def test_the_item_limit_applies_to_known_headers() -> None:
    body = bytes(2 * 224 * 224 * 3)
    parse(body, HEADERS, max_items=2)
    with pytest.raises(TooManyItems):
        parse(body, HEADERS, max_items=1)


def test_a_refused_pair_is_refused_every_time() -> None:
    headers = {"x-tensor-dtype": "uint8", "x-tensor-shape": "2,224,224,4"}
    for _ in range(2):
        with pytest.raises(InvalidTensor, match="does not fit the model"):
            parse(bytes(2 * 224 * 224 * 4), headers)


def test_dtype_is_read_case_and_space_blind() -> None:
    headers = {"x-tensor-dtype": " UInt8 ", "x-tensor-shape": "[1, 224, 224, 3]"}
    assert parse(bytes(224 * 224 * 3), headers).dtype == np.uint8
