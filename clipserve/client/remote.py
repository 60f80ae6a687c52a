"""The service over HTTP: `RemoteEngine` packs images into msgpack requests within the server's
limits (GET /info), keeps `concurrency` requests in flight on one keep-alive connection pool,
retries what is safe to retry and turns every other answer into the client's own errors.

Embedding is idempotent, so any request may be sent again: after a refused or reset
connection or a proxy's 502, and after 503/429 (no sooner than `Retry-After`). A timeout
(504 or 408, or no answer within the deadline) is not retried: the deadline is spent, and
resending would add load to a server that is already slow. In a list one bad image fails the
server's whole request, naming it (`item N: ...`); that item is set aside and the rest sent
again, so every good item is embedded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import numpy as np

from clipserve import __version__
from clipserve.client import wire
from clipserve.client.engine import Embedded, Mode, empty
from clipserve.client.errors import (
    ClientError,
    Overloaded,
    RequestTimedOut,
    ServerError,
    ServerGone,
    Unauthorized,
)
from clipserve.client.inputs import Payload, Unusable, crop, png
from clipserve.client.retry import RetryPolicy, parse_retry_after
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec

log = logging.getLogger("clipserve.client")
ImageFormat = Literal["encoded", "tensor"]
PROBE_TIMEOUT_S = 2.0  # GET /readyz in auto mode: a live server answers in milliseconds
CONNECT_TIMEOUT_S = 5.0
# The client waits this much longer than the deadline it sends, so the server's own 504
# arrives (with its reason) before the client gives up.
DEADLINE_GRACE_S = 2.0
# 503 codes that mean no worker will take the request soon: the service is as good as gone.
GONE_CODES = ("not_ready", "shutting_down")
# Refusals of the request's content, which name the bad item in a list.
ITEM_STATUSES = (400, 413, 422)
# Refusals of the request itself, never of its one item.
NOT_ITEM_CODES = ("invalid_body", "invalid_header", "invalid_parameter", "too_many_items")
# A 500 for a request of several images is sent again in halves, down to the image that fails
# (the server fails a batch's items together when one breaks it); this many single images
# failing with 500 in a row, none answered between, is a broken server: the call raises.
FAILING_IN_A_ROW = 8


class RemoteEngine:
    """One httpx.AsyncClient (keep-alive pool) per engine; `start` reads GET /info."""

    mode: Mode = "remote"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        batch_size: int = 32,
        concurrency: int = 4,
        timeout_s: float = 60.0,
        retries: int = 5,
        image_format: ImageFormat = "encoded",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        headers = {
            "User-Agent": f"clipserve-client/{__version__}",
            "X-Request-Timeout-Ms": str(max(1, round(timeout_s * 1000))),
        }
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        pool = concurrency + 1  # the batches' requests, and one for /info or a probe
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(
                timeout_s + DEADLINE_GRACE_S, connect=min(timeout_s, CONNECT_TIMEOUT_S), pool=None
            ),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
            transport=transport,
        )
        self._batch_size = batch_size
        self._in_flight = asyncio.Semaphore(concurrency)  # across calls sharing this engine
        self._policy = RetryPolicy(retries)
        self._rng = random.Random()
        self._image_format = image_format
        self._workers = os.cpu_count() or 1
        self._pool: ThreadPoolExecutor | None = None  # arrays to PNG, tensor-mode crops
        self._card: dict[str, Any] | None = None
        self._decoder: ImageDecoder | None = None
        self._failing = 0  # single images answered 500 since the last answer (FAILING_IN_A_ROW)

    # ---- what the server told us --------------------------------------------------------------

    @property
    def card(self) -> dict[str, Any]:
        if self._card is None:
            raise RuntimeError("RemoteEngine.start() has not run")
        return self._card

    @property
    def dim(self) -> int:
        return int(self.card["embed_dim"])

    @property
    def max_items(self) -> int:
        """The client's batch size, within what one request may hold and what the server's
        queue can ever admit at once (a larger request would be refused 503 forever)."""
        limits, batching = self.card["limits"], self.card.get("batching", {})
        queue = int(batching.get("max_queue_size", self._batch_size))
        return max(1, min(self._batch_size, int(limits["max_items_per_request"]), queue))

    @property
    def max_body_bytes(self) -> int:
        return int(self.card["limits"]["max_body_bytes"])

    async def ready(self) -> bool:
        """Whether GET /readyz answers 200 within a short timeout."""
        try:
            r = await self._http.get("/readyz", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def start(self) -> None:
        if self._card is not None:
            return
        self._card = await self.info()
        try:
            # What every mode reads later, read now through the same properties: a card
            # without it is refused here, not as a KeyError mid-embedding.
            _ = (str(self.card["model"]), self.dim, self.max_items, self.max_body_bytes)
            self._use_card(self.card)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            self._card = None  # not a clipserve card
            why = f"GET /info: not a model card this client reads ({type(e).__name__}: {e})"
            raise ServerError(200, "bad_answer", why) from None

    def _use_card(self, card: dict[str, Any]) -> None:
        if self._image_format == "tensor":
            size = card["input_size"]
            spec = PreprocessSpec(
                (int(size[0]), int(size[1])),
                tuple(card["mean"]),
                tuple(card["std"]),
                card.get("interpolation", "bicubic"),
                card.get("resize_mode", "shortest"),
            )
            lim = card["limits"]
            self._decoder = ImageDecoder(
                spec,
                int(lim["max_image_pixels"]),
                max_bytes=int(lim["max_decode_bytes"]),
                max_aspect=float(lim["max_image_aspect"]),
            )

    async def info(self) -> dict[str, Any]:
        answer = await self._request("GET", "/info")
        try:
            card = answer.json()
        except ValueError:  # JSON and UTF-8 errors both: a proxy's page, not the server's card
            card = None
        if not isinstance(card, dict):
            why = f"GET /info: not a JSON object ({answer.headers.get('content-type', 'no type')})"
            raise ServerError(answer.status_code, "bad_answer", why)
        return card

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- embedding ----------------------------------------------------------------------------

    async def embed_images(self, payloads: Sequence[Payload]) -> Embedded:
        out = Embedded(empty(len(payloads), self.dim))
        items = await self._prepare(payloads, out.errors)
        for group in self._pack(items, out.errors):
            await self._send_images(group, out)
        return out

    async def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        answer = await self._request("POST", "/embed/text", wire.texts_body(texts), len(texts))
        return self._read(answer, len(texts))

    async def _prepare(
        self, payloads: Sequence[Payload], errors: dict[int, str]
    ) -> list[tuple[int, bytes | np.ndarray]]:
        """What goes on the wire for each payload: encoded bytes (arrays as PNG), or in tensor
        mode the crop, made here with the server's own preprocessing."""
        decoder = self._decoder
        if decoder is None and not any(isinstance(p, np.ndarray) for p in payloads):
            return [(i, p) for i, p in enumerate(payloads) if isinstance(p, bytes)]

        def one(payload: Payload) -> bytes | np.ndarray:
            if decoder is not None:
                return crop(decoder, payload)
            return png(payload) if isinstance(payload, np.ndarray) else payload

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="clipserve-client")
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(
            *(loop.run_in_executor(self._pool, one, p) for p in payloads), return_exceptions=True
        )
        items: list[tuple[int, bytes | np.ndarray]] = []
        for i, result in enumerate(done):
            if isinstance(result, Unusable):
                errors[i] = result.reason
            elif isinstance(result, BaseException):
                raise result
            else:
                items.append((i, result))
        return items

    def _pack(
        self, items: list[tuple[int, bytes | np.ndarray]], errors: dict[int, str]
    ) -> list[list[tuple[int, bytes | np.ndarray]]]:
        """Consecutive groups within max_items and the server's body limit; an item over
        the limit on its own is an error, never sent."""
        budget = self.max_body_bytes - wire.ENVELOPE_BYTES
        groups: list[list[tuple[int, bytes | np.ndarray]]] = []
        group: list[tuple[int, bytes | np.ndarray]] = []
        used = 0
        for position, item in items:
            size = wire.item_bytes(item)
            if size > budget:
                errors[position] = (
                    f"{size} bytes; the server takes at most {self.max_body_bytes} bytes per "
                    "request (--max-body-bytes)"
                )
                continue
            if group and (len(group) == self.max_items or used + size > budget):
                groups.append(group)
                group, used = [], 0
            group.append((position, item))
            used += size
        if group:
            groups.append(group)
        return groups

    async def _send_images(
        self, group: list[tuple[int, bytes | np.ndarray]], out: Embedded
    ) -> None:
        """One request for the group; each item it is refused for is set aside (an error) and
        the rest sent again."""
        while group:
            items = [item for _, item in group]
            if self._decoder is not None:
                body = wire.tensor_body([i for i in items if isinstance(i, np.ndarray)])
            else:
                body = wire.images_body([i for i in items if isinstance(i, bytes)])
            try:
                answer = await self._request("POST", "/embed", body, len(group), splittable=True)
            except Unusable as e:
                position, _ = group.pop(e.position)
                out.errors[position] = e.reason
                continue
            except _Split:
                half = len(group) // 2
                await self._send_images(group[:half], out)
                await self._send_images(group[half:], out)
                return
            except ServerError as e:
                if e.status != 500 or len(group) != 1:
                    raise
                self._failing += 1
                if self._failing >= FAILING_IN_A_ROW:
                    raise ServerError(
                        500, e.code, f"{e.message} ({self._failing} in a row)"
                    ) from None
                out.errors[group[0][0]] = f"the server failed on it: {e}"
                return
            self._failing = 0
            out.vectors[[p for p, _ in group]] = self._read(answer, len(group))
            return

    def _read(self, answer: httpx.Response, n: int) -> np.ndarray:
        try:
            return wire.embeddings(answer.content, n)
        except wire.BadAnswer as e:
            raise ServerError(answer.status_code, "bad_answer", str(e)) from None

    # ---- one request, retried -----------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        items: int = 0,
        *,
        splittable: bool = False,
    ) -> httpx.Response:
        """The 2xx answer, after retries; Unusable(reason, position) when the server refuses
        one of the request's `items`; with `splittable`, _Split for a 413 that blames no item
        or a 500; the client's errors for everything else."""
        headers = wire.HEADERS if body is not None else None
        attempt = 0
        while True:
            retry_after: float | None = None
            try:
                async with self._in_flight:
                    r = await self._http.request(method, path, content=body, headers=headers)
            except (httpx.ConnectTimeout, httpx.PoolTimeout) as e:
                failure: ClientError = ServerGone(f"{self.url}: cannot connect ({_why(e)})")
            except httpx.TimeoutException as e:
                raise RequestTimedOut(f"{method} {self.url}{path}: no answer ({_why(e)})") from e
            except httpx.TransportError as e:  # refused, reset, closed without an answer
                failure = ServerGone(f"{self.url}: {_why(e)}")
            except httpx.RequestError as e:  # an answer httpx cannot read (a proxy's encoding)
                raise ServerError(0, "unreadable_answer", f"{method} {path}: {_why(e)}") from e
            else:
                if r.status_code < 300:
                    return r
                refusal = wire.Refusal.of(r.status_code, r.content)
                if r.status_code not in (429, 502, 503):
                    raise _refused(refusal, items, f"{method} {path}", splittable)
                # 502: a proxy in front of a server that is down or restarting.
                gone = r.status_code == 502 or refusal.code in GONE_CODES
                kind = ServerGone if gone else Overloaded
                failure = kind(f"{self.url}: {r.status_code} {refusal.code}: {refusal.message}")
                retry_after = parse_retry_after(r.headers.get("retry-after"))
            if attempt >= self._policy.retries:
                raise failure
            wait = self._policy.delay(attempt, retry_after, self._rng)
            attempt += 1
            log.debug("%s; retry %d of %d in %.2f s", failure, attempt, self._policy.retries, wait)
            await asyncio.sleep(wait)


def _why(e: httpx.HTTPError) -> str:
    return str(e) or type(e).__name__


class _Split(Exception):
    """The request is sent again in halves: a 413 that names no item (a body limit on the way,
    a proxy's, lower than the server's: nginx's default is 1 MiB), or a 500 (an item that
    breaks the server's batch takes the others down with it)."""


def _refused(refusal: wire.Refusal, items: int, what: str, splittable: bool) -> Exception:
    """The exception for an error answer that is not worth retrying."""
    status = refusal.status
    if status == 500 and items > 1 and splittable:
        return _Split()
    if status == 401:
        return Unauthorized(f"{what}: {refusal.message}")
    if status in (408, 504):  # the body sent too slowly, or the answer too late
        return RequestTimedOut(f"{what}: {refusal.message}")
    if status in ITEM_STATUSES and items:
        if refusal.item is not None and 0 <= refusal.item < items:
            return Unusable(refusal.reason, refusal.item)
        if status == 413 and items > 1 and splittable:
            return _Split()
        if items == 1 and refusal.code not in NOT_ITEM_CODES:
            return Unusable(refusal.message, 0)
    return ServerError(status, refusal.code, f"{what}: {refusal.message}")
