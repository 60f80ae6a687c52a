"""The per-request helpers the pipeline reads a request with: `HeaderMap` answers as Starlette's
`Headers` does, and `StageTimer` sums each stage's blocks."""

from __future__ import annotations

import time

import pytest
from starlette.datastructures import Headers

from clipserve.http.asgi import HeaderMap
from clipserve.http.timing import StageTimer

RAW = [
    (b"content-type", b"application/octet-stream"),
    (b"x-tensor-shape", b"1,224,224,3"),
    (b"x-tensor-shape", b"9,9,9"),  # repeated: the first wins, as in Headers
    (b"x-note", "caf\u00e9".encode("latin-1")),  # a byte past ASCII: latin-1, as in Headers
    (b"content-length", b"150528"),
    (b"x-empty", b""),  # present, with nothing in it: not the default
]


@pytest.mark.parametrize(
    "name",
    ["content-type", "Content-Type", "X-TENSOR-SHAPE", "x-note", "content-length", "x-empty"],
)
def test_header_map_answers_as_starlette_headers(name: str) -> None:
    ours, theirs = HeaderMap(RAW), Headers(raw=RAW)
    assert ours[name] == theirs[name]
    assert ours.get(name) == theirs.get(name)
    assert (name in ours) == (name in theirs)


def test_header_map_missing_and_the_rest_of_the_interface() -> None:
    ours, theirs = HeaderMap(RAW), Headers(raw=RAW)
    assert ours.get("x-missing") is None
    assert ours.get("x-missing", "d") == "d"
    assert ours.get("x-empty", "d") == ""
    assert "x-missing" not in ours
    assert 3 not in ours  # not a name at all
    with pytest.raises(KeyError):
        ours["x-missing"]
    assert ours.getlist("x-tensor-shape") == theirs.getlist("x-tensor-shape")
    assert ours.raw == theirs.raw
    assert list(ours.items()) == list(theirs.items())


def test_stage_timer_sums_blocks_and_ignores_negative_adds() -> None:
    timer = StageTimer()
    with timer.measure("decode"):
        time.sleep(0.002)
    with timer.measure("decode"):
        time.sleep(0.002)
    timer.add("queue", 0.5)
    timer.add("queue", -1.0)  # a clock's step back adds nothing
    with pytest.raises(ValueError), timer.measure("encode"):
        raise ValueError("a failed block still counts its time")
    assert timer.stages["decode"] >= 0.004
    assert timer.stages["queue"] == 0.5
    assert timer.stages["encode"] >= 0.0
    assert list(timer.stages) == ["decode", "queue", "encode"]
    header = timer.header()
    assert header.startswith("decode;dur=")
    assert ", queue;dur=500.000, encode;dur=" in header


def test_header_map_names_no_header_could_have() -> None:
    ours = HeaderMap(RAW)
    assert ours.get("x-\u20ac") is None  # not latin-1: no such header, not an error
    assert "x-\u20ac" not in ours
    with pytest.raises(KeyError):
        ours["x-\u20ac"]
