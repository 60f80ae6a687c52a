"""The seam between the request flow and batching: one tower (image or text) as the pipeline
sees it, whether a `Batcher` in this process or the engine's through a `RemoteTower`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, runtime_checkable

import numpy as np

TowerKind = Literal["image", "text"]
TOWER_KINDS: tuple[TowerKind, ...] = ("image", "text")


@dataclass
class Completed:
    """Embeddings of one request, in order, and when its items queued and computed."""

    embeddings: np.ndarray  # (N, D) float32
    queue_s: float
    compute_s: float


class WorkerView(Protocol):
    """One device worker as the probes and gauges see it."""

    @property
    def device(self) -> str: ...

    @property
    def kind(self) -> TowerKind: ...

    @property
    def alive(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


TicketSelf = TypeVar("TicketSelf", bound="Ticket")


class Ticket(Protocol):
    """A request's places in one tower's queue."""

    def release_all(self) -> None: ...

    def absorb(self: TicketSelf, other: TicketSelf) -> None: ...


TicketT = TypeVar("TicketT", bound=Ticket)


class TowerState(Protocol):
    """What probes and gauges read of a tower."""

    @property
    def alive(self) -> bool: ...

    @property
    def workers(self) -> Sequence[WorkerView]: ...

    def depth(self) -> int: ...


class Tower(TowerState, Protocol[TicketT]):
    """One tower's batching, with the ticket type its admission hands out."""

    async def reserve(self, n: int, deadline: float) -> TicketT: ...

    async def run(
        self, ticket: TicketT, arrays: Sequence[np.ndarray], *, normalize: bool, request_id: str
    ) -> Completed: ...


@runtime_checkable
class CachingTower(Tower[TicketT], Protocol[TicketT]):
    """A tower with the embedding cache (`batching/cache.py`) behind it. Keys are made by the
    caller (`http/cache_keys.py`); `lookup` answers from the cache alone, before anything is
    admitted or decoded, and a keyed `run` computes each key once however many wait on it."""

    async def lookup(self, keys: Sequence[bytes]) -> list[np.ndarray | None]: ...

    async def run(
        self,
        ticket: TicketT,
        arrays: Sequence[np.ndarray],
        *,
        normalize: bool,
        request_id: str,
        keys: Sequence[bytes] | None = None,
        fresh: bool = False,
    ) -> Completed: ...
