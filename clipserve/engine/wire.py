"""The control channel's frames: a 4-byte length, then one msgpack map with a type `t`.

Front end → engine (`id` is the front end's number for one request's tower work):
  hello   {pid, path, count, slot_bytes}     its slot file; answered by `card`
  admit   {id, tower, n, wait_s}             reserve n places (the global bounded queue)
  run     {id, ids, tower, slots, dtype, shape, normalize, rid}   items are in the slots;
                                             `ids`: the admissions it uses (id is the first)
  release {ids}                              give back admissions never run (no answer)
  cancel  {id}                               the client went away (answered as `run` is)
Engine → front end:
  card    {model, backend, devices, precision, status}
  ok      {id}                               admitted
  done    {id, queue_s, compute_s}           embeddings are in the run's slots
  error   {id, error}                        a ClipserveError to raise, see `encode_error`
  status  {towers, depth, wait_s, memory}    pushed a few times a second and on change
Every `admit` and every `run` gets exactly one answer; a slot is reused only after it.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from clipserve import errors

_LENGTH = struct.Struct(">I")
MAX_FRAME = 16 << 20  # frames carry slot numbers, never pixels


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next frame; asyncio.IncompleteReadError at a clean end of stream."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME:
        raise ValueError(f"control frame of {length} bytes")
    frame = msgpack.unpackb(await reader.readexactly(length), raw=False)
    if not isinstance(frame, dict):
        raise ValueError("control frame is not a map")
    return frame


def frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def encode_error(error: BaseException) -> dict[str, Any]:
    """A domain error as data; anything else becomes an opaque internal error."""
    if not isinstance(error, errors.ClipserveError):
        return {"cls": "ExecutorFailed", "message": "internal error"}
    encoded: dict[str, Any] = {"cls": type(error).__name__, "message": error.message}
    retry = getattr(error, "retry_after_s", None)
    if retry is not None:
        encoded["retry"] = retry
    return encoded


def decode_error(encoded: dict[str, Any]) -> errors.ClipserveError:
    """The same class and message in this process (unknown names: an internal error)."""
    cls = getattr(errors, str(encoded.get("cls")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ClipserveError)):
        cls = errors.ExecutorFailed
    error = cls.__new__(cls)
    errors.ClipserveError.__init__(error, str(encoded.get("message", "internal error")))
    if "retry" in encoded:
        error.retry_after_s = int(encoded["retry"])  # type: ignore[attr-defined]
    return error
