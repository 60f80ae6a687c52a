"""The control channel: a stream of msgpack maps over a Unix socket, each with a type `t`.

The types of every frame are in `messages.py`. `id` is the front end's number for one request's
work in one tower: an admission, then the run that uses it.

Front end → engine:
  hello   {pid, path, count, slot_bytes}      its slot file; answered by `card`
  admit   {id, tower, n, wait_s}              reserve n places in the tower's queue (the global
                                              bound); answered by `ok` or `error`
  lookup  {id, tower, keys}                   the embedding cache's rows for these keys, before
                                              anything is admitted or decoded; answered by
                                              `found`
  run     {id, ids, tower, slots, dtype, shapes, normalize, rid, keys?, fresh?}
                                              the items are in `slots`, one per item, all of
                                              `dtype`; `ids`: the admissions it uses (`id` is the
                                              first); `keys`: each item's cache key (or null;
                                              absent: none), `fresh`: no-cache (absent: false);
                                              answered by `done` or `error`
  release {ids}                               give back admissions never run (no answer)
  cancel  {id}                                the client went away: the run ends early, still
                                              with its one answer (`error`; `done` if it had
                                              finished)
Engine → front end:
  card    {name, weights_id, embed_dim, context_length, preprocess, backend, devices,
           precision, batching, towers, depth, wait_s, memory}
                                              the model card and the status, on hello
  ok      {id}                                admitted
  done    {id, dim, queue_s, compute_s}       the run's embeddings are in its slots, float32
                                              rows of `dim`
  found   {id, hits, dim, rows}               the keys found (their indices) and their rows:
                                              float32 bytes, 2-3 KiB a row, in the frame itself
  error   {id, error: {cls, message, retry?}} a ClipserveError to raise, see `encode_error`
  status  {towers, depth, wait_s, memory}     pushed a few times a second: `towers` maps each
                                              tower to its workers' {device, alive, error}
Every `admit`, `lookup` and `run` gets exactly one answer; a slot is reused only after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar, cast

import msgpack

from clipserve import errors
from clipserve.engine.messages import EncodedError, ToEngine, ToFront

log = logging.getLogger(__name__)
MAX_BUFFER = 16 << 20  # frames carry slot numbers, never pixels; `found`: see `found_limit`

InT = TypeVar("InT", bound=Mapping[str, object])
OutT = TypeVar("OutT", bound=Mapping[str, object])


class StreamTransport(Protocol):
    """What a channel uses of its transport. uvloop's stream transports have it but are no
    `asyncio.Transport` (they share no base class with asyncio's own)."""

    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...


class Channel(asyncio.Protocol, Generic[InT, OutT]):
    """msgpack maps over a stream (msgpack delimits itself), receiving `InT` and sending `OutT`.
    Frames sent in one event-loop iteration leave in one write: a finished batch answers all its
    requests with one syscall."""

    def __init__(
        self,
        on_message: Callable[[InT], None],
        on_lost: Callable[[], None] = lambda: None,
        max_buffer: int = MAX_BUFFER,
    ) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: StreamTransport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        # A frame past it closes the channel (msgpack's BufferFull): size it to the largest
        # frame the peer may send.
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max_buffer)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(StreamTransport, transport)  # a stream's: see StreamTransport

    def data_received(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
            for message in self._unpacker:
                if not isinstance(message, dict):
                    raise ValueError("control frame is not a map")
                # Not validated field by field: the peer is this same code in a process of the
                # same supervisor. A frame missing a field raises here and closes the channel.
                self.on_message(cast(InT, message))
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
        return self.transport is not None and not self.transport.is_closing()

    def send(self, message: OutT) -> None:
        if not self.open:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(self._packer.pack(message))

    def _flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()


def found_limit(max_items: int, embed_dim: int) -> int:
    """What a front end's channel must take: a `found` frame carries the cached rows of a
    whole request in the frame itself (float32, and an index each), up to `max_items`."""
    return MAX_BUFFER + max_items * (embed_dim * 4 + 16)


# Each side's channel: what it receives, what it sends.
EngineChannel = Channel[ToEngine, ToFront]
FrontChannel = Channel[ToFront, ToEngine]


def encode_error(error: BaseException) -> EncodedError:
    """A domain error as data; anything else becomes an opaque internal error."""
    if not isinstance(error, errors.ClipserveError):
        return {"cls": "ExecutorFailed", "message": "internal error"}
    encoded: EncodedError = {"cls": type(error).__name__, "message": error.message}
    if isinstance(error, errors.Overloaded | errors.NotReady):
        encoded["retry"] = error.retry_after_s
    return encoded


def decode_error(encoded: EncodedError) -> errors.ClipserveError:
    """The same class and message in this process (unknown names: an internal error)."""
    cls = getattr(errors, encoded["cls"], None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ClipserveError)):
        cls = errors.ExecutorFailed
    error = cls.__new__(cls)
    errors.ClipserveError.__init__(error, encoded["message"])
    if "retry" in encoded and isinstance(error, errors.Overloaded | errors.NotReady):
        error.retry_after_s = encoded["retry"]
    return error
