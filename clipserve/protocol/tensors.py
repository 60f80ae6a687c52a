"""Tensors on the wire as (dtype, shape, bytes): validated before any allocation, never unpickled.

Layouts follow `GET /info`: uint8 NHWC at the model's input size, or normalised float16/float32
NCHW. The returned array is a zero-copy view of the request body.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clipserve.errors import InvalidTensor, TooManyItems

DTYPES = {"uint8": np.uint8, "float16": np.float16, "float32": np.float32}
MAX_DIM = 1 << 20  # far above any real dimension; stops absurd shapes before arithmetic
FLOAT16_MAX = 65504.0
MAX_SHAPE_HEADER = 64  # four dimensions of up to 7 digits each, with room for spaces


def check_count(n: int, max_items: int) -> None:
    if n > max_items:
        raise TooManyItems(
            f"{n} images in one request; the limit is {max_items} (--max-items-per-request)"
        )


def parse_shape(raw: str) -> list[int]:
    """'2,224,224,3' (a header) → [2, 224, 224, 3]."""
    if len(raw) > MAX_SHAPE_HEADER:
        raise InvalidTensor(
            f"shape header of {len(raw)} characters; a rank-4 shape needs "
            f"at most {MAX_SHAPE_HEADER}"
        )
    try:
        return [int(part) for part in raw.replace(" ", "").strip("[]()").split(",") if part]
    except ValueError:
        raise InvalidTensor(f"shape {raw!r} is not a comma-separated list of integers") from None


def expected_layout(dtype: str, size: tuple[int, int]) -> tuple[int, int, int]:
    h, w = size
    return (h, w, 3) if dtype == "uint8" else (3, h, w)


def parse_tensor(
    dtype: str,
    shape: Sequence[object],
    data: bytes | memoryview,
    size: tuple[int, int],
    max_items: int,
) -> np.ndarray:
    """`data` as an array of `shape` (a view: nothing is copied), once dtype, shape and length
    fit the model's layout; `size` is its (height, width)."""
    return tensor_view(tensor_layout(dtype, shape, size, max_items), data)


@dataclass(frozen=True)
class TensorLayout:
    """A request tensor's dtype and shape, checked against the model: all but its bytes."""

    dtype: str
    dims: tuple[int, ...]
    nbytes: int  # what the body must hold


def tensor_layout(
    dtype: str, shape: Sequence[object], size: tuple[int, int], max_items: int
) -> TensorLayout:
    """`parse_tensor`'s checks of dtype and shape (InvalidTensor, TooManyItems)."""
    if dtype not in DTYPES:
        raise InvalidTensor(f"dtype {dtype!r} is not supported; use uint8, float16 or float32")
    dims = [d for d in shape if isinstance(d, int) and not isinstance(d, bool)]
    if len(dims) != len(shape):
        raise InvalidTensor(f"shape {list(shape)} must hold integers")
    if len(dims) != 4:
        raise InvalidTensor(f"shape {dims} has rank {len(dims)}; expected 4 (a batch of images)")
    if any(d < 0 or d > MAX_DIM for d in dims):
        raise InvalidTensor(f"shape {dims} has a negative or absurd dimension")
    n, rest = dims[0], tuple(dims[1:])
    if n == 0:
        raise InvalidTensor("the tensor holds no images (batch dimension 0)")
    check_count(n, max_items)
    layout = expected_layout(dtype, size)
    if rest != layout:
        kind = "NHWC" if dtype == "uint8" else "NCHW"
        raise InvalidTensor(
            f"shape {dims} does not fit the model: {dtype} tensors are {kind} "
            f"[N, {', '.join(map(str, layout))}] (see GET /info)"
        )
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    return TensorLayout(dtype, tuple(dims), math.prod(dims) * itemsize)


def tensor_view(layout: TensorLayout, data: bytes | memoryview) -> np.ndarray:
    """`data` as an array of `layout` (a view), once its length fits; floats range-checked."""
    if len(data) != layout.nbytes:
        raise InvalidTensor(
            f"shape {list(layout.dims)} of {layout.dtype} needs {layout.nbytes} bytes; "
            f"got {len(data)}"
        )
    array = np.frombuffer(data, dtype=DTYPES[layout.dtype]).reshape(layout.dims)
    if layout.dtype != "uint8":
        check_range(array)
    return array


def check_range(array: np.ndarray) -> None:
    """Finite and within float16's range. Normalised pixels lie within about ±3; beyond
    ±65504 an fp16 backend overflows and float32 ones (3e38) give infinite embeddings."""
    lo, hi = float(array.min()), float(array.max())  # NaN propagates; no temporary array
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InvalidTensor("the tensor holds NaN or infinite values")
    if lo < -FLOAT16_MAX or hi > FLOAT16_MAX:
        raise InvalidTensor(
            f"the tensor holds a value of magnitude {max(-lo, hi):.4g}; inputs must lie within "
            f"float16's range (|x| <= {FLOAT16_MAX:g}); normalised images lie within about ±3"
        )
