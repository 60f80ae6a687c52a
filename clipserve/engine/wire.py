"""The control channel: a stream of msgpack maps over a Unix socket, each with a type `t`.

Front end → engine (`id` is the front end's number for one request's tower work):
  hello   {pid, path, count, slot_bytes}     its slot file; answered by `card`
  admit   {id, tower, n, wait_s}             reserve n places (the global bounded queue)
  run     {id, ids, tower, slots, dtype, shapes, normalize, rid}  items are in the slots;
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
import logging
from collections.abc import Callable
from typing import Any

import msgpack

from clipserve import errors

log = logging.getLogger(__name__)
MAX_BUFFER = 16 << 20  # frames carry slot numbers, never pixels


class Channel(asyncio.Protocol):
    """msgpack maps over a stream (msgpack delimits itself). Frames sent in one event-loop
    iteration leave in one write: a finished batch answers all its requests with one syscall."""

    def __init__(
        self,
        on_message: Callable[[dict[str, Any]], None],
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: Any = None  # an asyncio or uvloop transport (not a common base class)
        self.closed = asyncio.get_running_loop().create_future()
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_BUFFER)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
            for message in self._unpacker:
                if not isinstance(message, dict):
                    raise ValueError("control frame is not a map")
                self.on_message(message)
        except Exception:
            log.exception("control channel: bad frame; closing it")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)
        self.on_lost()

    @property
    def open(self) -> bool:
        return self.transport is not None and not bool(self.transport.is_closing())

    def send(self, message: dict[str, Any]) -> None:
        if not self.open:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(self._packer.pack(message))

    def _flush(self) -> None:
        if self.open:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()


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
