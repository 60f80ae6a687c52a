"""One request's walk from body to answer: the only path from HTTP or gRPC to the towers.

Every front door's inference route runs `Pipeline.run` with its own `Call` (http/work.py) and
its transport's `Exchange` (http/exchange.py; http/asgi.py for HTTP):
deadline -> read the body -> admit one place -> parse in the pool -> grow the admission to the
parsed size -> decode -> batch -> encode -> respond. Admission comes before any CPU work, parsing
included, so the pool's backlog is bounded by the queue for every protocol alike. Stage timing,
the per-protocol metrics and client disconnects are handled here, once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast

import numpy as np
from starlette.requests import Request

from clipserve.batching.tower import CachingTower, Completed, TicketT, Tower, TowerKind
from clipserve.config import ServerConfig
from clipserve.errors import ClipserveError, with_item_index
from clipserve.http import health
from clipserve.http.cache_keys import CacheKeys, Found
from clipserve.http.charges import refund_unused
from clipserve.http.counted import RequestMetrics
from clipserve.http.exchange import Exchange
from clipserve.http.fetch import ImageFetcher
from clipserve.http.names import ServedNames
from clipserve.http.request import BodyBudget, RequestContext, timed_out, unless_gone
from clipserve.http.shm_regions import SharedMemoryRegions
from clipserve.http.work import Call, Embedded, Encoded, ImageWork, Parsed, TextWork, Work
from clipserve.inference.model import LoadedModel
from clipserve.inference.preprocess import ImageDecoder
from clipserve.metrics import Metrics

T = TypeVar("T")
P = ParamSpec("P")


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

    @property
    def self_check(self) -> dict[str, Any] | None: ...

    def tokenize(
        self, texts: list[str], *, truncate: bool = True, positions: Sequence[int] | None = None
    ) -> np.ndarray: ...

    def decode_workers(self, requested: int) -> int: ...


@dataclass
class Admitted(Generic[TicketT]):
    """A request's places in one tower's queue (see `Pipeline.admitted`)."""

    ticket: TicketT
    n: int


def pipeline_of(request: Request) -> Pipeline[Any]:
    """The pipeline the app's lifespan built, as every route reaches it."""
    pipeline: Pipeline[Any] = request.state.pipeline
    return pipeline


class Pipeline(Generic[TicketT]):
    """Built by the app's lifespan over the two towers, which hand out tickets of one type."""

    def __init__(
        self,
        config: ServerConfig,
        runtime: Serving,
        image: Tower[TicketT],
        text: Tower[TicketT],
        metrics: Metrics,
        decode_pool: ThreadPoolExecutor,
        body_budget: BodyBudget | None = None,
        regions: SharedMemoryRegions | None = None,
    ) -> None:
        self.config = config
        self.runtime = runtime
        model = runtime.model
        self.names = ServedNames.of(config.model, model.name, model.identity)
        self.towers: dict[TowerKind, Tower[TicketT]] = {"image": image, "text": text}
        self.metrics = metrics
        self.counted = RequestMetrics(metrics)  # an answered request's metrics
        self.stopping = False
        # Asked per request where the cache is on: a runtime-checkable Protocol's isinstance
        # costs ~10 µs, so each tower is checked once.
        self._caching = {id(t) for t in self.towers.values() if isinstance(t, CachingTower)}
        self.decode_pool = decode_pool
        # --max-body-bytes-in-flight: this process's own, unless the front ends share one.
        self.body_budget = body_budget or BodyBudget(config.limits.max_body_bytes_in_flight)
        self.fetcher = ImageFetcher(config.access)
        # Triton's system shared memory: this process's, unless the front ends share a table.
        lim = config.limits
        self.regions = regions or SharedMemoryRegions(lim.shm_max_regions, lim.shm_max_bytes)
        self.cache_keys = (  # None: --cache-mb 0, nothing is hashed
            CacheKeys.of(config, model, runtime.backend, runtime.precision)
            if config.cache.cache_mb
            else None
        )

    def readiness(self) -> health.Readiness:
        """Every probe's answer: workers alive, the startup self-check not failed, and not
        stopping (`stopping` is set on SIGTERM, for --shutdown-delay-s)."""
        return health.readiness(self.towers, self.runtime.self_check, self.stopping)

    async def run(self, exchange: Exchange, call: Call[Parsed]) -> tuple[RequestContext, Encoded]:
        """The same steps in the same order for every front door, over HTTP or gRPC: the
        request's context and its encoded answer, counted in the metrics."""
        t0 = time.perf_counter()
        try:
            # `request`'s steps, spelled out on this per-request path (no generator to drive).
            server_s = self.config.limits.request_timeout_s
            timeout_s = exchange.timeout_s(server_s)
            ctx = RequestContext(exchange.request_id, exchange.timer, t0 + timeout_s, exchange.gone)
            try:
                async with asyncio.timeout(timeout_s):
                    work, done = await self._walk(exchange, call, ctx)
            except TimeoutError:
                name = exchange.deadline_name
                raise timed_out(timeout_s, server_s, name, in_body=not ctx.body_read) from None
            finally:
                self.body_budget.release(ctx.reserved_bytes)
            with ctx.timer.measure("encode"):
                encoded = call.encode(work, done)
        except ClipserveError:
            self.counted.failed(call.tower, time.perf_counter() - t0)
            raise
        tower = call.tower
        self.counted.succeeded(
            tower,
            work.protocol,
            time.perf_counter() - t0,
            ctx.timer.stages,
            work.count(tower),
            ctx.body_bytes,
            len(encoded.content),
        )
        return ctx, encoded

    async def _walk(
        self, exchange: Exchange, call: Call[Parsed], ctx: RequestContext
    ) -> tuple[Work[Parsed], Embedded]:
        """Body, one place, parse, embed: `run`'s steps within the deadline."""
        with ctx.timer.measure("receive"):
            limit = self.config.limits.max_body_bytes
            body = await exchange.body(limit, self.body_budget, ctx)
        ctx.body_bytes, ctx.body_read = len(body), True
        # `admitted`'s steps, spelled out on this per-request path (no generator to drive).
        held = Admitted(await self.towers[call.tower].reserve(1, ctx.deadline), 1)
        try:
            with ctx.timer.measure("decode"):  # parsing the body counts as decoding
                work = call.parse(body) if call.inline else await self.in_pool(call.parse, body)
            if work.held_bytes:  # read from shared memory: held as a body's are (503 past it)
                self.body_budget.reserve(work.held_bytes)
                ctx.reserved_bytes += work.held_bytes
            work.fresh = exchange.fresh
            exchange.note_items(work.count("image") + work.count("text"))
            return work, await self.embed(work, ctx, call.tower, held)
        finally:
            held.ticket.release_all()

    async def in_pool(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """CPU work (parsing, decoding, tokenising) goes to the pool, never onto the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.decode_pool, functools.partial(fn, *args, **kwargs))

    @asynccontextmanager
    async def admitted(
        self, tower: Tower[TicketT], ctx: RequestContext, n: int = 1
    ) -> AsyncIterator[Admitted[TicketT]]:
        """Places in `tower`'s queue for the request, held until the block ends: the one owner
        of the admission (items give theirs back as they start computing)."""
        held = Admitted(await tower.reserve(n, ctx.deadline), n)
        try:
            yield held
        finally:
            held.ticket.release_all()

    async def _grown(
        self, tower: Tower[TicketT], ctx: RequestContext, n: int, held: Admitted[TicketT]
    ) -> TicketT:
        """`held`'s ticket, grown to n places if the parsed body holds more than was admitted
        before parsing. `held` stays its owner's to release."""
        if n > held.n:
            held.ticket.absorb(await tower.reserve(n - held.n, ctx.deadline))
            held.n = n
        return held.ticket

    async def embed(
        self, work: Work[Any], ctx: RequestContext, tower: TowerKind, held: Admitted[TicketT]
    ) -> Embedded:
        """Both towers' parts of `work`, at once; the place held in `tower` serves its part,
        or is given back now if the request has none there."""
        if work.count(tower) == 0:
            held.ticket.release_all()
            refund_unused(held.n)
        image_held = held if tower == "image" else None
        text_held = held if tower == "text" else None
        if work.texts is None and work.images is not None:  # most requests: awaited here
            only = await self.embed_images(work.images, ctx, work.normalize, image_held, work.fresh)
            return Embedded(images=only, texts=None)
        jobs: list[Awaitable[Completed]] = []
        if work.texts is not None:
            jobs.append(self.embed_texts(work.texts, ctx, work.normalize, text_held, work.fresh))
        if work.images is not None:
            jobs.append(self.embed_images(work.images, ctx, work.normalize, image_held, work.fresh))
        results = iter(await _all(jobs))
        texts = next(results) if work.texts is not None else None
        images = next(results) if work.images is not None else None
        return Embedded(images=images, texts=texts)

    async def embed_images(
        self,
        work: ImageWork,
        ctx: RequestContext,
        normalize: bool = True,
        admitted: Admitted[TicketT] | None = None,
        fresh: bool = False,
    ) -> Completed:
        """Look in the cache, admit (or grow `admitted` to) what it lacks, decode that in the
        pool, batch, wait: the image tower's embeddings, in order."""
        tower = self.towers["image"]
        # Before admission and decoding: a cached image costs neither. URLs: keyed once
        # fetched (the engine still answers them from the cache, or merges them in flight).
        found = None if work.urls else await self._cached(tower, ctx, work, normalize, fresh)
        if found is not None and not found.missing:
            return found.merged(None)
        todo = work.count if found is None else len(found.missing)
        if admitted is None:  # places of its own, held until its images are answered
            async with self.admitted(tower, ctx, todo) as own:
                return await self._image_rows(work, ctx, normalize, own.ticket, found, fresh)
        ticket = (
            admitted.ticket if todo <= admitted.n else await self._grown(tower, ctx, todo, admitted)
        )
        return await self._image_rows(work, ctx, normalize, ticket, found, fresh)

    async def _image_rows(
        self,
        work: ImageWork,
        ctx: RequestContext,
        normalize: bool,
        ticket: TicketT,
        found: Found | None,
        fresh: bool,
    ) -> Completed:
        """`embed_images` once admitted: fetch the URLs, decode, batch, wait."""
        tower = self.towers["image"]
        # URLs are fetched once the request holds its places (and has paid its rate
        # limit's tokens for them): an over-limit or overloaded request fetches nothing.
        images = await self._fetched(work, ctx) if work.urls else work
        if work.urls:
            found = await self._cached(tower, ctx, images, normalize, fresh, lookup=False)
        only = found.missing if found else None
        with ctx.timer.measure("decode"):
            if images.tensor is not None:  # zero-copy rows, stacked on the device thread
                picked = range(images.count) if only is None else only
                arrays = [images.tensor[i] for i in picked]
            else:
                arrays = await self._decoded(images, only)
        return await self._run(tower, ticket, arrays, ctx, normalize, found, fresh)

    async def embed_texts(
        self,
        work: TextWork,
        ctx: RequestContext,
        normalize: bool = True,
        admitted: Admitted[TicketT] | None = None,
        fresh: bool = False,
    ) -> Completed:
        """Tokenise in the pool (unless the door did), look in the cache, admit (or grow
        `admitted` to) what it lacks, batch, wait: the text tower's embeddings, in order.
        The tokens are the key, so tokenising comes before admission (as parsing does)."""
        tower = self.towers["text"]
        tokens = work.tokens
        if tokens is None:
            with ctx.timer.measure("decode"):
                tokens = await self.in_pool(self.runtime.tokenize, work.texts)
        found = await self._cached(tower, ctx, tokens, normalize, fresh)
        if found is not None and not found.missing:
            return found.merged(None)
        todo = len(tokens) if found is None else len(found.missing)
        rows = list(tokens) if found is None else [tokens[i] for i in found.missing]
        if admitted is None:  # places of its own, held until its texts are answered
            async with self.admitted(tower, ctx, todo) as own:
                return await self._run(tower, own.ticket, rows, ctx, normalize, found, fresh)
        ticket = await self._grown(tower, ctx, todo, admitted)
        return await self._run(tower, ticket, rows, ctx, normalize, found, fresh)

    async def _fetched(self, work: ImageWork, ctx: RequestContext) -> ImageWork:
        """`work` with its image URLs fetched (--allow-url-fetch)."""
        at = [work.positions[i] if work.positions else i for i in work.urls]
        with ctx.timer.measure("fetch"):
            fetched = await self.fetcher.fetch_all(list(zip(at, work.urls.values(), strict=True)))
        images = list(work.images)
        for i, data in zip(work.urls, fetched, strict=True):
            images[i] = data
        return dataclasses.replace(work, images=images, urls={})

    async def _decoded(
        self, work: ImageWork, only: Sequence[int] | None = None
    ) -> list[np.ndarray]:
        """The encoded images (those at `only`: not cached) decoded in the pool for the tower."""
        picked = range(work.count) if only is None else only
        # The decoder, or with --decode gpu the header checks (JPEG bytes pass through).
        prepare = self.runtime.image_input or self.runtime.decoder
        results: list[np.ndarray | BaseException]
        if len(picked) == 1:  # most requests: awaited in this task (gather makes one more)
            try:
                results = [await self.in_pool(prepare, work.images[picked[0]])]
            except Exception as e:
                results = [e]
        else:
            jobs = [self.in_pool(prepare, work.images[i]) for i in picked]
            results = await asyncio.gather(*jobs, return_exceptions=True)
        arrays: list[np.ndarray] = []
        for index, result in zip(picked, results, strict=True):
            if isinstance(result, ClipserveError):
                at = work.positions[index] if work.positions else index
                raise result if work.single else with_item_index(result, at)
            if isinstance(result, BaseException):
                raise result
            arrays.append(result)
        return arrays

    async def _run(
        self,
        tower: Tower[TicketT],
        ticket: TicketT,
        arrays: Sequence[np.ndarray],
        ctx: RequestContext,
        normalize: bool,
        found: Found | None = None,
        fresh: bool = False,
    ) -> Completed:
        """The tower's rows for `arrays`; with `found`, those are its missing items, and the
        answer is the whole request's."""
        t0 = time.perf_counter()
        rid = ctx.request_id
        if found is not None and id(tower) in self._caching:
            keys = [found.keys[i] for i in found.missing]
            run = cast(CachingTower[TicketT], tower).run(
                ticket, arrays, normalize=normalize, request_id=rid, keys=keys, fresh=fresh
            )
        else:
            run = tower.run(ticket, arrays, normalize=normalize, request_id=rid)
        try:
            completed = await unless_gone(ctx.gone, run, ctx.watch)  # the deadline: the ticket's
        except BaseException as e:
            ctx.timer.add("queue", time.perf_counter() - t0)  # a failed request shows its wait
            if found is not None and isinstance(e, ClipserveError):
                raise found.located(e) from None
            raise
        ctx.timer.add("queue", completed.queue_s)
        ctx.timer.add("compute", completed.compute_s)
        return completed if found is None else found.merged(completed)

    async def _cached(
        self,
        tower: Tower[TicketT],
        ctx: RequestContext,
        items: ImageWork | np.ndarray,
        normalize: bool,
        fresh: bool,
        lookup: bool = True,
    ) -> Found | None:
        """The cache keys of a request's images or token rows, and what the cache holds of
        them (nothing looked up under no-cache); None when the cache is off."""
        keys_of = self.cache_keys
        if keys_of is None:
            return None
        with ctx.timer.measure("cache"):
            if isinstance(items, ImageWork):  # reads every byte: the pool's work
                keys = await self.in_pool(keys_of.images, items, normalize)
            else:  # a few hundred bytes a text
                keys = keys_of.texts(items, normalize)
            rows: list[np.ndarray | None] = [None] * len(keys)
            if lookup and not fresh and id(tower) in self._caching:
                rows = await cast(CachingTower[TicketT], tower).lookup(keys)
        return Found(rows, keys)


async def _all(jobs: Sequence[Awaitable[T]]) -> list[T]:
    """Await every job; the first failure cancels the others (their items leave the queue)."""
    if len(jobs) == 1:
        return [await jobs[0]]
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:  # the failure itself, not a sibling's cancellation
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
    return [task.result() for task in tasks]
