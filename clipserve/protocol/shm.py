"""Triton's system shared-memory extension as a request names it: an input's or output's data
lives in a registered region, at an offset, instead of in the message. Pure: the regions
themselves (opened, bounded, read and written) are `clipserve.http.shm_regions`.

The three parameters are the same over HTTP (JSON values) and gRPC (`InferParameter` values,
turned into Python values by the gRPC codec first).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from clipserve.errors import InvalidTensor

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"


@dataclass(frozen=True)
class RegionRef:
    """Where one tensor's bytes are: `byte_size` bytes at `offset` in region `name`."""

    name: str
    offset: int
    byte_size: int


# How a codec reaches the regions: read a tensor's bytes (at most the int: the caller's
# bound, checked before reading), write an output's, check that an output's fits (the int:
# its bytes) before any work is done for it.
ReadRegion = Callable[[RegionRef, int], bytes]
WriteRegion = Callable[[RegionRef, bytes], None]
FitRegion = Callable[[RegionRef, int], object]


def _count(params: Mapping[str, object], key: str, what: str, default: int | None) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise InvalidTensor(f"{what}: {key} must be a non-negative integer, got {value!r}")
    return value


def region_ref(params: Mapping[str, object], what: str) -> RegionRef | None:
    """The region a tensor's parameters name (None: its data is in the message); `what`
    names the tensor in errors."""
    name = params.get(REGION)
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise InvalidTensor(f"{what}: {REGION} must be a region's name, got {name!r}")
    size = _count(params, BYTE_SIZE, what, None)
    offset = _count(params, OFFSET, what, 0)
    return RegionRef(name, offset, size)
