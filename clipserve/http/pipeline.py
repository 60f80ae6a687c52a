"""One request's walk from body to embeddings: the only path from HTTP to the batchers.

Handlers (`routes.py`, `openai_api.py`, `kserve_api.py`) turn their wire format into work with
the codecs in `protocol/` and call `embed_images` / `embed_texts`. Everything between happens
here, once: the deadline, body limits, admission, decoding in the pool, the batcher, client
disconnects, stage timing and the per-protocol metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from clipserve.batching import Completed
from clipserve.config import ServerConfig
from clipserve.errors import (
    ClipserveError,
    InvalidHeader,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    with_item_index,
)
from clipserve.http.timing import StageTimer
from clipserve.inference.model import LoadedModel
from clipserve.inference.preprocess import ImageDecoder
from clipserve.metrics import Metrics

T = TypeVar("T")
DEADLINE_HEADER = "x-request-timeout-ms"


class Serving(Protocol):
    """What the pipeline needs of the model: `Runtime` in one process, a front end's
    `FrontRuntime` (no weights) with --workers N."""

    config: ServerConfig
    model: LoadedModel
    backend: str
    decoder: ImageDecoder
    image_input: Callable[[bytes], np.ndarray] | None  # --decode gpu: checks, not decoding

    @property
    def devices(self) -> list[str]: ...

    @property
    def precision(self) -> str: ...

    def tokenize(self, texts: list[str]) -> np.ndarray: ...

    def decode_workers(self, requested: int) -> int: ...


class WorkerView(Protocol):
    @property
    def device(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


class Ticket(Protocol):
    def release_all(self) -> None: ...

    def absorb(self, other: Any) -> None: ...


class Tower(Protocol):
    """One tower's batching: a Batcher here, or the engine's through a RemoteTower."""

    @property
    def alive(self) -> bool: ...

    @property
    def workers(self) -> Sequence[WorkerView]: ...

    def depth(self) -> int: ...

    async def reserve(self, n: int, deadline: float) -> Any: ...

    async def run(
        self, ticket: Any, arrays: Sequence[np.ndarray], *, normalize: bool, request_id: str
    ) -> Completed: ...


@dataclass
class Admitted:
    """A request's places in one tower's queue (see `Pipeline.admitted`)."""

    ticket: Ticket
    n: int


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class ImageWork:
    """A request's images: encoded (decoded in the pool) or an already validated tensor."""

    protocol: str  # the metrics label: jpeg, multipart, raw-tensor, openai-image, ...
    images: Sequence[bytes] = ()
    tensor: np.ndarray | None = None
    single: bool = False  # one image in, one embedding out (not a list)
    positions: Sequence[int] = ()  # each image's index in a request that mixes in texts (errors)

    @property
    def count(self) -> int:
        return len(self.tensor) if self.tensor is not None else len(self.images)


@dataclass
class TextWork:
    protocol: str
    texts: list[str]
    tokens: np.ndarray | None = None  # already tokenised (e.g. to count usage): not done twice


@dataclass
class RequestContext:
    """What the pipeline knows about one request while it runs."""

    request_id: str
    timer: StageTimer
    deadline: float  # time.perf_counter() by which the answer must be ready
    receive: Receive  # watched for a disconnect while the request waits for its batch
    body_bytes: int = 0
    reserved_bytes: int = 0  # share of --max-body-bytes-in-flight held until the request ends


class BodyBudget:
    """Bytes of request bodies held in memory across all requests; past it, 503 overloaded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def reserve(self, n: int) -> None:
        if self.used + n > self.capacity:
            raise Overloaded(
                f"request bodies in memory would exceed {self.capacity} bytes "
                "(--max-body-bytes-in-flight); retry later"
            )
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first (its items leave the queue)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not task.cancelled():
            task.exception()  # retrieved, even when our own cancellation wins the race
    if task.cancelled():
        raise ClientGone()
    return task.result()


def request_timeout(headers: Mapping[str, str], server_timeout_s: float) -> float:
    """The server's timeout, shortened by the client's `X-Request-Timeout-Ms` if it sent one."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return server_timeout_s
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not ms > 0 or ms == float("inf"):
        raise InvalidHeader(f"X-Request-Timeout-Ms: expected a positive number, got {raw[:40]!r}")
    return min(ms / 1000, server_timeout_s)


def of(request: Request) -> Pipeline:
    """The pipeline the app's lifespan built, as every handler reaches it."""
    return request.state.server  # type: ignore[no-any-return]


class Pipeline:
    """Built by the app's lifespan; reached by handlers through `pipeline.of(request)`."""

    def __init__(
        self,
        config: ServerConfig,
        runtime: Serving,
        batcher: Tower,
        text_batcher: Tower,
        metrics: Metrics,
        decode_pool: ThreadPoolExecutor,
    ) -> None:
        self.config = config
        self.runtime = runtime
        self.batcher = batcher
        self.text_batcher = text_batcher
        self.metrics = metrics
        self.decode_pool = decode_pool
        self.body_budget = BodyBudget(config.limits.max_body_bytes_in_flight)

    @asynccontextmanager
    async def request(self, request: Request) -> AsyncIterator[RequestContext]:
        """The request's deadline (receiving the body included) and its stage timer."""
        timeout_s = request_timeout(request.headers, self.config.limits.request_timeout_s)
        timer = request.state.timer = StageTimer()  # error responses report the stages done too
        ctx = RequestContext(
            request.state.request_id, timer, time.perf_counter() + timeout_s, request.receive
        )
        try:
            async with asyncio.timeout(timeout_s):
                yield ctx
        except TimeoutError:
            server_s = self.config.limits.request_timeout_s
            limit = "X-Request-Timeout-Ms" if timeout_s < server_s else "--request-timeout-s"
            raise RequestTimeout(f"request took longer than {timeout_s:g} s ({limit})") from None
        finally:
            self.body_budget.release(ctx.reserved_bytes)

    async def read_body(self, request: Request, ctx: RequestContext) -> bytes:
        """The whole body, within --max-body-bytes and the in-flight budget shared by all."""
        limit = self.config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        with ctx.timer.measure("receive"):
            digits = declared is not None and declared.isascii() and declared.isdigit()
            if declared is not None and digits and (len(declared) > 19 or int(declared) > limit):
                raise PayloadTooLarge(
                    f"body of {declared[:20]} bytes exceeds {limit} (--max-body-bytes)"
                )
            # Reserved as bytes arrive, not as declared: a client that declares a large body
            # and stalls holds only what it sent (headers alone must not lock uploads out).
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"body exceeds {limit} bytes (--max-body-bytes)")
                self._reserve(ctx, len(chunk))
                chunks.append(chunk)
        ctx.body_bytes = size
        return b"".join(chunks)

    def _reserve(self, ctx: RequestContext, n: int) -> None:
        self.body_budget.reserve(n)
        ctx.reserved_bytes += n

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work (parsing, decoding, tokenising) goes to the pool, never onto the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, fn, *args)

    @asynccontextmanager
    async def admitted(
        self, tower: Tower, ctx: RequestContext, n: int = 1
    ) -> AsyncIterator[Admitted]:
        """Places in `tower`'s queue for the request, held until the block ends: the one owner
        of the admission (items give theirs back as they start computing). Taken before any
        CPU work, parsing included, so the backlog in the pool is bounded by the queue too."""
        held = Admitted(await tower.reserve(n, ctx.deadline), n)
        try:
            yield held
        finally:
            held.ticket.release_all()

    @asynccontextmanager
    async def _admitted_for(
        self, tower: Tower, ctx: RequestContext, n: int, held: Admitted | None
    ) -> AsyncIterator[Any]:
        if held is None:
            async with self.admitted(tower, ctx, n) as own:
                yield own.ticket
            return
        if n > held.n:  # the parsed body holds more than was admitted before parsing
            held.ticket.absorb(await tower.reserve(n - held.n, ctx.deadline))
            held.n = n
        yield held.ticket

    async def embed_images(
        self,
        work: ImageWork,
        ctx: RequestContext,
        *,
        normalize: bool = True,
        admitted: Admitted | None = None,
    ) -> Completed:
        """Admit (or grow `admitted` to the request's size), decode in the pool, batch, wait:
        the image tower's embeddings, in order."""
        async with self._admitted_for(self.batcher, ctx, work.count, admitted) as ticket:
            with ctx.timer.measure("decode"):
                arrays = await self._images(work)
            return await self._run(self.batcher, ticket, arrays, ctx, normalize)

    async def embed_texts(
        self,
        work: TextWork,
        ctx: RequestContext,
        *,
        normalize: bool = True,
        admitted: Admitted | None = None,
    ) -> Completed:
        """Admit, tokenise in the pool, batch, wait: the text tower's embeddings, in order."""
        async with self._admitted_for(self.text_batcher, ctx, len(work.texts), admitted) as t:
            with ctx.timer.measure("decode"):
                tokens = work.tokens
                if tokens is None:
                    tokens = await self.in_pool(self.runtime.tokenize, work.texts)
            return await self._run(self.text_batcher, t, list(tokens), ctx, normalize)

    async def _images(self, work: ImageWork) -> Sequence[np.ndarray]:
        if work.tensor is not None:
            return list(work.tensor)  # zero-copy rows; stacked on the device thread
        # The decoder, or with --decode gpu the header checks (JPEG bytes pass through).
        prepare = self.runtime.image_input or self.runtime.decoder
        jobs = [self.in_pool(prepare, data) for data in work.images]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, ClipserveError):
                at = work.positions[index] if work.positions else index
                raise result if work.single else with_item_index(result, at)
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    async def _run(
        self,
        batcher: Tower,
        ticket: Ticket,
        arrays: Sequence[np.ndarray],
        ctx: RequestContext,
        normalize: bool,
    ) -> Completed:
        t0 = time.perf_counter()
        try:
            completed = await unless_disconnected(
                ctx.receive,
                batcher.run(ticket, arrays, normalize=normalize, request_id=ctx.request_id),
            )  # the deadline rides on the ticket
        except BaseException:
            ctx.timer.add("queue", time.perf_counter() - t0)  # a failed request shows its wait
            raise
        ctx.timer.add("queue", completed.queue_s)
        ctx.timer.add("compute", completed.compute_s)
        return completed

    def respond(
        self,
        ctx: RequestContext,
        protocol: str,
        content: bytes,
        media_type: str,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """The 200 answer, with its stages in Server-Timing and in the per-protocol metrics."""
        for stage, seconds in ctx.timer.stages.items():
            self.metrics.stage_duration.labels(stage, protocol).observe(seconds)
        self.metrics.request_bytes.labels(protocol).inc(ctx.body_bytes)
        self.metrics.response_bytes.labels(protocol).inc(len(content))
        headers = dict(headers or {})
        headers["Server-Timing"] = ctx.timer.header()
        return Response(content, media_type=media_type, headers=headers)
