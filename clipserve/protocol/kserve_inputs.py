"""The one input tensor of a KServe v2 inference request → encoded images, texts or an array.

An input's data comes as JSON `data` or, with Triton's binary tensor extension, as raw bytes
(`binary_data_size` of them) after the JSON header. A BYTES element in binary is a 4-byte
little-endian length and the bytes; in JSON, where strings must be text, an encoded image is its
base64. Shapes and element counts are checked before any data is copied.

Or the data is in a registered shared-memory region (`SharedInput`), which a client may name
whole (up to --shm-max-bytes, 1 GiB): it is read only once its byte count is checked, against
what the shape needs (numeric inputs) or --max-body-bytes (BYTES), as if it came in the body.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from clipserve.errors import (
    InvalidBody,
    InvalidImage,
    InvalidTensor,
    InvalidText,
    PayloadTooLarge,
    TooManyTexts,
    with_item_index,
)
from clipserve.protocol.shm import BYTE_SIZE, ReadRegion, RegionRef, region_ref
from clipserve.protocol.tensors import (
    MAX_DIM,
    TensorLayout,
    check_count,
    expected_layout,
    tensor_layout,
    tensor_view,
)
from clipserve.protocol.text import check_length
from clipserve.protocol.urls import is_url, url_refused

if TYPE_CHECKING:
    from clipserve.batching.tower import TowerKind

NUMERIC = {"UINT8": "uint8", "FP16": "float16", "FP32": "float32"}  # datatype → numpy dtype
LENGTH = struct.Struct("<I")  # a BYTES element's length prefix


@dataclass(frozen=True)
class SharedInput:
    """An input's data in a shared-memory region, not read yet: its size is checked first."""

    ref: RegionRef
    read: ReadRegion
    max_bytes: int  # the most read for one input (--max-body-bytes, as in a body)

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:  # a door that reads regions says how much it takes
            raise ValueError("a shared-memory reader needs its cap (--max-body-bytes)")

    def exactly(self, layout: TensorLayout) -> memoryview:
        """A numeric input's bytes: as many as its shape needs, or none read at all."""
        if self.ref.byte_size != layout.nbytes:
            raise InvalidTensor(
                f"shape {list(layout.dims)} of {layout.dtype} needs {layout.nbytes} bytes; "
                f"got {self.ref.byte_size} ({BYTE_SIZE})"
            )
        self._within(layout.nbytes)
        return memoryview(self.read(self.ref, layout.nbytes))

    def at_most(self) -> memoryview:
        """A BYTES input's bytes, refused unread past --max-body-bytes."""
        self._within(self.ref.byte_size)
        return memoryview(self.read(self.ref, self.max_bytes))

    def _within(self, size: int) -> None:
        """No more than a body may hold: the region is read into this process's memory."""
        if size > self.max_bytes:
            raise PayloadTooLarge(
                f"{BYTE_SIZE} {size} exceeds {self.max_bytes} bytes (--max-body-bytes)"
            )


@dataclass(frozen=True)
class InputTensor:
    """The request's one input: its JSON description, and its bytes when sent in binary."""

    spec: dict[str, Any]  # name, datatype, shape, parameters; `data` when sent in JSON
    binary: memoryview | None  # None: the data is JSON, or in `shared`
    shared: SharedInput | None = None  # the data is in a shared-memory region

    @property
    def in_json(self) -> bool:
        return self.binary is None and self.shared is None

    @property
    def datatype(self) -> str:
        return str(self.spec["datatype"])

    @property
    def dims(self) -> list[int]:
        shape = self.spec.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape
        ):
            raise InvalidTensor(f"shape {shape!r} must be a list of non-negative integers")
        return [int(d) for d in shape]


def input_tensor(
    doc: dict[str, Any],
    binary: memoryview,
    read_region: ReadRegion | None = None,
    *,
    max_shared_bytes: int,
) -> InputTensor:
    """The request's one input, with the binary data after the JSON header if it names it,
    or the shared-memory region it names (read later, once checked, and at most
    `max_shared_bytes`: the door's --max-body-bytes)."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        count = len(inputs) if isinstance(inputs, list) else 0
        raise InvalidBody(f'"inputs" must hold exactly one input tensor; got {count}')
    spec: dict[str, Any] = inputs[0]
    if not isinstance(spec.get("name"), str) or not isinstance(spec.get("datatype"), str):
        raise InvalidBody('an input needs "name", "shape" and "datatype"')
    params = spec.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidBody('"parameters" of an input must be an object')
    ref = region_ref(params, f"input {spec['name']!r}")
    if ref is not None:
        if read_region is None:
            raise InvalidTensor("shared memory is not served here; send the data in the body")
        if binary:
            raise InvalidBody(
                f"binary data after the JSON header, but input {spec['name']!r} is in shared memory"
            )
        return InputTensor(spec, None, SharedInput(ref, read_region, max_shared_bytes))
    size = params.get("binary_data_size")
    if size is None:
        if binary:
            raise InvalidBody(
                "binary data after the JSON header, but no input has binary_data_size"
            )
        if "data" not in spec:
            raise InvalidBody(f"input {spec['name']!r} has neither data nor binary_data_size")
        return InputTensor(spec, None)
    if isinstance(size, bool) or not isinstance(size, int) or size != len(binary):
        raise InvalidBody(
            f"binary_data_size {size!r} does not match the {len(binary)} bytes "
            "after the JSON header"
        )
    return InputTensor(spec, binary)


def _element_count(dims: list[int], max_items: int, tower: TowerKind) -> int:
    """BYTES inputs hold one item per element: shape [N] or [N, 1]."""
    if not (len(dims) == 1 or (len(dims) == 2 and dims[1] == 1)):
        raise InvalidTensor(f"shape {dims}: BYTES inputs are [N] or [N, 1], one item each")
    n = dims[0]
    if n == 0:
        raise InvalidTensor("the input holds no elements (shape [0])")
    if tower == "text" and n > max_items:
        raise TooManyTexts(
            f"{n} texts in one request; the limit is {max_items} (--max-items-per-request)"
        )
    check_count(n, max_items)
    return n


def _bytes_data(tensor: InputTensor) -> memoryview:
    """A BYTES input's binary data: the body's, or its region's (read once its element count
    is checked)."""
    if tensor.shared is not None:
        return tensor.shared.at_most()
    assert tensor.binary is not None
    return tensor.binary


def _binary_elements(raw: memoryview, n: int) -> list[bytes]:
    """Triton's BYTES layout: each element a 4-byte little-endian length, then its bytes."""
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(elements) == n:
            raise InvalidTensor(f"BYTES data holds more than the {n} elements of its shape")
        if offset + 4 > len(raw):
            raise InvalidTensor(f"BYTES element {len(elements)}: truncated length prefix")
        (size,) = LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + size > len(raw):
            # The length read is not echoed: the data may be a shared memory region's.
            raise InvalidTensor(f"BYTES element {len(elements)}: its length runs past the data")
        elements.append(bytes(raw[offset : offset + size]))
        offset += size
    if len(elements) != n:
        raise InvalidTensor(f"BYTES data holds {len(elements)} elements; the shape says {n}")
    return elements


def _json_strings(data: object, n: int) -> list[str]:
    """JSON BYTES data: n strings, flat or nested one level ([N, 1])."""
    if not isinstance(data, list):
        raise InvalidTensor('"data" must be an array')
    flat = [x[0] if isinstance(x, list) and len(x) == 1 else x for x in data]
    if len(flat) != n:
        raise InvalidTensor(f'"data" holds {len(flat)} elements; the shape says {n}')
    for index, item in enumerate(flat):
        if not isinstance(item, str):
            raise InvalidTensor(f"element {index}: BYTES data in JSON must be strings")
    return flat


def images_of(tensor: InputTensor, max_items: int) -> list[bytes]:
    """A BYTES input's encoded images."""
    n = _element_count(tensor.dims, max_items, "image")
    if not tensor.in_json:
        return _binary_elements(_bytes_data(tensor), n)
    images = []
    for index, item in enumerate(_json_strings(tensor.spec.get("data"), n)):
        if is_url(item):
            raise with_item_index(url_refused(), index)
        try:
            images.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidImage(
                f"item {index}: in JSON, BYTES images must be base64 (or send binary data)"
            ) from None
    return images


def texts_of(
    tensor: InputTensor, max_items: int, max_chars: int, truncate: bool = False
) -> list[str]:
    """A BYTES input's UTF-8 texts."""
    n = _element_count(tensor.dims, max_items, "text")
    if tensor.in_json:
        texts = _json_strings(tensor.spec.get("data"), n)
    else:
        texts = []
        for index, element in enumerate(_binary_elements(_bytes_data(tensor), n)):
            try:
                texts.append(element.decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidText(f"item {index}: not UTF-8 text") from None
    return [check_length(text, index, max_chars, truncate) for index, text in enumerate(texts)]


def _check_image_shape(datatype: str, dims: list[int], size: tuple[int, int]) -> None:
    """The model's layout for this datatype, checked before JSON data becomes an array."""
    dtype = NUMERIC[datatype]
    layout = expected_layout(dtype, size)
    if len(dims) != 4 or tuple(dims[1:]) != layout or dims[0] == 0:
        kind = "NHWC" if dtype == "uint8" else "NCHW"
        raise InvalidTensor(
            f"shape {dims} does not fit the model: {datatype} inputs are {kind} "
            f"[N, {', '.join(map(str, layout))}]"
        )


def _json_values(data: object, datatype: str, dims: list[int]) -> memoryview:
    """JSON numbers, checked against the datatype and shape, as the array's bytes."""
    dtype = NUMERIC[datatype]
    try:
        values = np.asarray(data)
    except (ValueError, TypeError):
        raise InvalidTensor('"data" must be a flat or nested array of numbers') from None
    integral = "iu" if dtype == "uint8" else "iuf"
    if values.dtype.kind not in integral:
        kind = "integers" if dtype == "uint8" else "numbers"
        raise InvalidTensor(f'"data" of a {datatype} input must hold {kind}')
    if values.size != math.prod(dims):
        raise InvalidTensor(
            f'"data" holds {values.size} values; shape {dims} needs {math.prod(dims)}'
        )
    if dtype == "uint8" and values.size and (values.min() < 0 or values.max() > 255):
        raise InvalidTensor('"data" of a UINT8 input must be within 0..255')
    # Out of float16's range becomes inf, which the tensor check refuses with a 400: numpy's
    # warning about it would be a log line per bad request.
    with np.errstate(over="ignore", invalid="ignore"):
        return memoryview(values.astype(dtype).tobytes())


def array_of(tensor: InputTensor, size: tuple[int, int], max_items: int) -> np.ndarray:
    """A UINT8, FP16 or FP32 input as an array in the model's layout; `size` is its (height,
    width). Binary data is not copied: the array is a view of the request body (or of the
    bytes read from the region, once the shape says how many)."""
    dims, datatype = tensor.dims, tensor.datatype
    _check_image_shape(datatype, dims, size)
    check_count(dims[0], max_items)
    layout = tensor_layout(NUMERIC[datatype], dims, size, max_items)
    if tensor.shared is not None:
        raw = tensor.shared.exactly(layout)
    elif tensor.binary is not None:
        raw = tensor.binary
    else:
        raw = _json_values(tensor.spec.get("data"), datatype, dims)
    return tensor_view(layout, raw)
