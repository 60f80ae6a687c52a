"""API keys and per-key quotas: who may call, and how many items a second.

Two parts. `AccessGuard`, an ASGI middleware inside the request observer, runs on the headers
alone, before any body byte is read: no key (`Authorization: Bearer`, or `X-API-Key`), or not
one of the file's, is a 401; a key whose bucket is empty is a 429 at once. It leaves the
request's `Charge` in a context variable. `MeteredTower` then takes the tokens where the
pipeline reserves places in a tower's queue, which it does once before parsing (one place)
and again when the parsed body holds more: so a request pays one token before its body is
parsed and one per item (image or text) in all, without the pipeline knowing about keys.

The buckets live in a `BucketTable`: shared memory under `--workers N`, so a quota holds in
total over all front ends. Probes stay open, and /metrics too unless --protect-metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic

import numpy as np
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from clipserve.batching.tower import CachingTower, Completed, TicketT, Tower, WorkerView
from clipserve.config import AccessConfig
from clipserve.errors import RateLimited, Unauthorized
from clipserve.http.buckets import BucketTable, retry_after
from clipserve.http.charges import Charge, charging, current_charge
from clipserve.http.keys import Grant, KeyFile, Rate, anonymous, parse_rate, read_keys
from clipserve.http.probes import METRICS_PATHS, OPEN_PATHS
from clipserve.metrics import rate_limited_counter

if TYPE_CHECKING:  # the supervisor imports check_access: not the doors and the pipeline
    from starlette.routing import Route

    from clipserve.http.status import ErrorPages

_BEARER = b"bearer "


def check_access(config: AccessConfig) -> None:
    """StartupError if the rate limit or the key file is bad (the supervisor checks before
    anything starts; each process then reads the file itself)."""
    default = parse_rate(config.rate_limit, "--rate-limit") if config.rate_limit else None
    if config.api_keys is not None:
        read_keys(config.api_keys, default)


class Access:
    """The key file (or none: everyone is `anonymous`), the bucket table and the 429 count;
    what the guard and the metered towers share."""

    def __init__(
        self, config: AccessConfig, table: BucketTable, registry: CollectorRegistry
    ) -> None:
        self.default = parse_rate(config.rate_limit, "--rate-limit") if config.rate_limit else None
        self.keys = KeyFile(config.api_keys, self.default) if config.api_keys else None
        self.everyone = anonymous(self.default)
        self.protect_metrics = config.protect_metrics and self.keys is not None
        self.table = table
        self.rate_limited = rate_limited_counter(registry)

    @classmethod
    def build(
        cls, config: AccessConfig, registry: CollectorRegistry, buckets: str | None = None
    ) -> Access | None:
        """None when neither keys nor a rate limit are set: nothing to check. `buckets`: the
        shared table's file (--workers N); else this process's own. StartupError for a bad
        key file or rate."""
        if config.api_keys is None and config.rate_limit is None:
            return None
        return cls(config, BucketTable(buckets), registry)

    def start(self) -> None:
        if self.keys is not None:
            self.keys.start()

    def close(self) -> None:
        if self.keys is not None:
            self.keys.stop()
        self.table.close()

    def open_path(self, path: str) -> bool:
        return path in OPEN_PATHS or (path in METRICS_PATHS and not self.protect_metrics)

    def grant_for(self, headers: Sequence[tuple[bytes, bytes]]) -> Grant | None:
        """The grant of the first valid key the headers carry; None if none."""
        if self.keys is None:
            return self.everyone
        ring = self.keys.ring  # one reading: a reload swaps the whole ring
        for name, value in headers:
            if name == b"authorization" and value[:7].lower() == _BEARER:
                grant = ring.find(value[7:].strip())
            elif name == b"x-api-key":
                grant = ring.find(value.strip())
            else:
                continue
            if grant is not None:
                return grant
        return None

    def wait_s(self, grant: Grant) -> float:
        """Seconds until the grant's bucket holds one token (0: it does now)."""
        rate = grant.rate
        if rate is None:
            return 0.0
        return max(0.0, (1.0 - self.table.available(grant.bucket, rate)) / rate.per_s)

    def take(self, charge: Charge, n: int) -> float:
        """`n` more items for the request; RateLimited if its bucket is short. A request as a
        whole needs min(its items, the burst) tokens: larger ones pass on a full bucket and
        leave a debt, so the rate holds over time and no request is refused for ever. Returns
        how many of them its prepaid tokens paid for (`give_back` needs it)."""
        rate = charge.grant.rate
        if rate is None:
            return 0.0
        prepaid = min(charge.prepaid, n)
        if prepaid:
            charge.prepaid -= prepaid
            if prepaid == n:
                return prepaid
        threshold = max(0.0, min(n - prepaid, rate.burst - charge.taken))
        wait = self.table.take(charge.grant.bucket, n - prepaid, threshold, rate)
        if wait > 0:
            charge.prepaid += prepaid
            # Its retry takes again what this request took (nothing is given back): the wait
            # covers that too, or a client that waits as told is refused again, for ever.
            raise self.refused(charge.grant, rate, wait + charge.taken / rate.per_s)
        charge.taken += n - prepaid
        return prepaid

    def give_back(self, charge: Charge, n: int, prepaid: float = 0.0) -> None:
        """`n` items `take` charged for and the server could not serve (`prepaid` of them paid
        for by the request's unused places: those stay the request's)."""
        rate = charge.grant.rate
        if rate is not None:
            charge.prepaid += prepaid
            if n > prepaid:
                self.table.give_back(charge.grant.bucket, n - prepaid, rate)
                charge.taken -= n - prepaid

    def refused(self, grant: Grant, rate: Rate, wait_s: float) -> RateLimited:
        self.rate_limited.labels(grant.label).inc()
        after = retry_after(wait_s)
        message = (
            f"rate limit of {rate.per_s:g} items/s (burst {rate.burst:g}) for {grant.label} "
            f"exceeded; retry in {after} s"
        )
        return RateLimited(message, after)


class AccessGuard:
    """The key check, and a 429 for a key whose bucket is empty, on the headers alone: for
    inference POSTs (`inference`), which are what tokens pay for; other POSTs (shared-memory
    registration, the repository index) cost nothing, as over gRPC."""

    def __init__(
        self,
        app: ASGIApp,
        access: Access,
        pages: ErrorPages,
        inference: Callable[[Scope], tuple[Route, Scope] | None],
    ) -> None:
        self.app = app
        self.access = access
        self.pages = pages
        self.inference = inference

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.access.open_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        grant = self.access.grant_for(scope["headers"])
        if grant is None:
            self._label(scope)
            sent = any(n in (b"authorization", b"x-api-key") for n, _ in scope["headers"])
            problem = (
                "the API key is not valid"
                if sent
                else "an API key is required: Authorization: Bearer <key>, or X-API-Key: <key>"
            )
            response = self.pages.render(path, 401, Unauthorized.code, problem)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["key"] = grant.label  # for the access line and span
        if grant.rate is not None and scope["method"] == "POST":
            found = self.inference(scope)
            wait = self.access.wait_s(grant) if found is not None else 0.0
            if found is not None and wait > 0:  # refused before the body is read
                scope["route"] = found[0]  # see _label
                error = self.access.refused(grant, grant.rate, wait)
                response = self.pages.render(
                    path, 429, error.code, error.message, error.retry_after_s
                )
                await response(scope, receive, send)
                return
        with charging(grant):
            await self.app(scope, receive, send)

    def _label(self, scope: Scope) -> None:
        """A refusal of an inference POST is counted and logged under its route, as its answer
        would have been (the router, which names it otherwise, is not reached)."""
        found = self.inference(scope) if scope["method"] == "POST" else None
        if found is not None:
            scope["route"] = found[0]


class MeteredTower(Generic[TicketT]):
    """A tower whose places cost the request's key a token each (see the module's notes); a
    reservation the tower refuses (queue full, not ready) gives its tokens back."""

    def __init__(self, tower: Tower[TicketT], access: Access) -> None:
        self.tower = tower
        self.access = access

    @property
    def alive(self) -> bool:
        return self.tower.alive

    @property
    def workers(self) -> Sequence[WorkerView]:
        return self.tower.workers

    def depth(self) -> int:
        return self.tower.depth()

    async def reserve(self, n: int, deadline: float) -> TicketT:
        charge = current_charge()
        if charge is None:
            return await self.tower.reserve(n, deadline)
        prepaid = self.access.take(charge, n)
        try:
            return await self.tower.reserve(n, deadline)
        except BaseException:
            self.access.give_back(charge, n, prepaid)
            raise

    async def lookup(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """The cache, as the tower has it: a cached item takes no place, so costs no token."""
        if isinstance(self.tower, CachingTower):
            return await self.tower.lookup(keys)
        return [None] * len(keys)

    async def run(
        self,
        ticket: TicketT,
        arrays: Sequence[np.ndarray],
        *,
        normalize: bool,
        request_id: str,
        keys: Sequence[bytes] | None = None,
        fresh: bool = False,
    ) -> Completed:
        if isinstance(self.tower, CachingTower):
            return await self.tower.run(
                ticket, arrays, normalize=normalize, request_id=request_id, keys=keys, fresh=fresh
            )
        return await self.tower.run(ticket, arrays, normalize=normalize, request_id=request_id)
