"""The front end's side of the control channel: towers that admit and run in the engine.

`RemoteTower` is a `Tower[RemoteTicket]` (`clipserve.batching.tower`), as a Batcher is a
`Tower[Ticket]`: what the pipeline and the probes use; the batching itself happens once, in the
engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clipserve.backends.device import is_cpu
from clipserve.batching.tower import CachingTower, Completed, TowerKind
from clipserve.config import ServerConfig, resolve_workers
from clipserve.engine import wire
from clipserve.engine.heartbeat import (
    HeartbeatWriter,
    heartbeat_path,
    keep_beating,
    replace_deadline_s,
    restart_deadline_s,
)
from clipserve.engine.messages import ModelCard, RunFrame, Status, ToEngine, ToFront, WorkerRow
from clipserve.engine.slots import SlotArena, segment_path
from clipserve.errors import NotReady
from clipserve.inference.model import LoadedModel
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.inference.towers import WorkerStatus, worker_statuses

log = logging.getLogger(__name__)
RECONNECT_S = 0.2
ENGINE_GONE = "the engine process is not available; retry"


def slot_bytes(card: ModelCard) -> int:
    """The largest item either way: a float32 CHW image, a row of tokens, an embedding."""
    h, w = card["preprocess"]["size"]
    return max(3 * h * w * 4, card["context_length"] * 8, card["embed_dim"] * 4)


def slot_count(config: ServerConfig, devices: int) -> int:
    """Enough for every item this front end can hold: both towers' queues full, plus what is
    computing (items leave the admission budget as they start, not as they finish: every
    device's batches in flight, and requests partly started)."""
    b = config.batching
    largest = max(b.max_batch_size, config.limits.max_items_per_request)
    return 2 * b.max_queue_size + 2 * (devices * b.pipeline_depth + 1) * largest


def served_config(config: ServerConfig, card: ModelCard) -> ServerConfig:
    """The config as the engine serves it (its device-dependent defaults resolved)."""
    batching = dataclasses.replace(config.batching, **card["batching"])
    return dataclasses.replace(config, batching=batching, defaulted=frozenset())


@dataclass
class FrontRuntime:
    """What a front end knows of the model: enough to parse, decode and tokenise, no weights."""

    config: ServerConfig  # as the engine serves it
    model: LoadedModel
    backend: str
    devices: list[str]
    precision: str
    decoder: ImageDecoder
    workers: int  # front-end processes sharing the host's cores
    image_input: Callable[[bytes], np.ndarray] | None = None
    self_check: dict[str, Any] | None = None  # the engine's

    @classmethod
    def from_card(cls, card: ModelCard, config: ServerConfig, slot_bytes: int) -> FrontRuntime:
        import open_clip

        from clipserve.inference.model import resolve_name

        pre = card["preprocess"]
        height, width = pre["size"]
        spec = PreprocessSpec(
            size=(height, width),
            mean=_rgb(pre["mean"]),
            std=_rgb(pre["std"]),
            interpolation=pre["interpolation"],
            resize_mode=pre["resize_mode"],
        )
        resolve_name(config.model.model)  # registers a JSON config, as the engine did
        model = LoadedModel(
            module=None,
            name=card["name"],
            weights_id=card["weights_id"],
            preprocess=spec,
            embed_dim=card["embed_dim"],
            tokenizer=open_clip.get_tokenizer(card["name"]),
            context_length=card["context_length"],
        )
        decoder = ImageDecoder.from_limits(spec, config.limits, config.backend.jpeg_scaling)
        image_input = None
        if config.backend.decode == "gpu":  # the engine decodes JPEGs that fit a slot
            from clipserve.inference.gpu_decode import EncodedAtAdmission

            image_input = EncodedAtAdmission(decoder, max_bytes=slot_bytes)
        return cls(
            config=served_config(config, card),
            model=model,
            backend=card["backend"],
            devices=list(card["devices"]),
            precision=card["precision"],
            decoder=decoder,
            workers=config.http.workers,
            image_input=image_input,
            self_check=card.get("self_check"),
        )

    def tokenize(
        self, texts: list[str], *, truncate: bool = True, positions: Sequence[int] | None = None
    ) -> np.ndarray:
        """CPU work: run it in the decode pool (see LoadedModel.tokenize)."""
        return self.model.tokenize(texts, truncate=truncate, positions=positions)

    def decode_workers(self, requested: int) -> int:
        """0 = auto: this process's share of the cores when a GPU computes; one thread with CPU
        inference, which needs the cores itself."""
        if requested:
            return requested
        on_cpu = all(is_cpu(d) for d in self.devices)
        return 1 if on_cpu else max(1, resolve_workers(0) // self.workers)


def _rgb(values: list[float]) -> tuple[float, float, float]:
    r, g, b = values
    return r, g, b


# What an answer resolves to: embeddings (`done`), cached rows (`found`), None (`ok`).
Answer = Completed | list[np.ndarray | None] | None


@dataclass(eq=False)
class _Pending:
    future: asyncio.Future[Answer]
    slots: list[int]
    size: int = 0  # a lookup's number of keys


class EngineLink:
    """One connection to the engine, reconnecting after the engine restarts. Every `admit`
    and `run` gets one answer; a run's slots are free again only once it has come.

    The engine pushes its status every 0.25 s: a connected engine silent for longer than
    --heartbeat-timeout-s is hung (stopped, or its loop blocked), and its workers count as dead
    (/readyz 503, new requests 503 at once) until it speaks again or the supervisor replaces
    it. The link also stamps this front end's own heartbeat, on this process's loop."""

    def __init__(self, socket_path: str, config: ServerConfig, card: ModelCard) -> None:
        self.socket_path = socket_path
        self.status: Status = {
            "towers": {},
            "depth": {"image": 0, "text": 0},
            "admitted": {"image": 0, "text": 0},
            "wait_s": 0.0,
            "memory": {},
        }
        served = served_config(config, card)
        self._slots = (slot_count(served, len(card["devices"])), slot_bytes(card))
        self._generation = 0
        self.arena = self._new_arena()
        self.connected = False
        self._channel: wire.FrontChannel | None = None
        self._pending: dict[int, _Pending] = {}
        self._ids = 0
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.get_running_loop().create_future()
        self.timeout_s = config.http.heartbeat_timeout_s
        self.start_s = config.http.engine_start_timeout_s  # the supervisor's for a new engine
        self._frame_limit = wire.found_limit(config.limits.max_items_per_request, card["embed_dim"])
        self._heard = time.monotonic()  # the engine's last frame
        self._beats: HeartbeatWriter | None = None
        self._beating: asyncio.Task[None] | None = None

    def silent_s(self) -> float:
        """Seconds since the connected engine last spoke (0 while not connected)."""
        return time.monotonic() - self._heard if self.connected else 0.0

    def silence(self) -> str | None:
        """Why the engine counts as hung, or None while it speaks (or is not connected)."""
        silent = self.silent_s()
        if silent <= self.timeout_s:
            return None
        return f"the engine process has not reported for {silent:.1f} s; retry"

    @property
    def gone(self) -> bool:
        """Liveness: the engine silent, or not connected, past the time the supervisor had to
        replace it (a hung one is killed at the timeout; a dead one is restarted, which may
        take a model load)."""
        if self.connected:
            return self.silent_s() > restart_deadline_s(self.timeout_s)
        return time.monotonic() - self._heard > replace_deadline_s(self.timeout_s, self.start_s)

    def snapshot(self) -> Status:
        """The engine's last pushed status; every worker dead while it is not connected or
        silent too long."""
        why = self.refusal()
        if why is None:
            return self.status
        towers: dict[TowerKind, list[WorkerRow]] = {
            kind: [{"device": w["device"], "alive": False, "error": why} for w in rows]
            for kind, rows in self.status["towers"].items()
        }
        return {**self.status, "towers": towers}

    async def start(self, timeout_s: float) -> None:
        """Connect (the engine is up before front ends start), keep reconnecting after."""
        path = heartbeat_path(Path(self.socket_path).parent, os.getpid())
        self._beats = HeartbeatWriter(path)
        self._beating = asyncio.create_task(keep_beating(self._beats))
        self._task = asyncio.create_task(self._maintain())
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(self._first)

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._beating) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._beats is not None:
            self._beats.close()
        self.arena.close(unlink=True)

    def _new_arena(self) -> SlotArena:
        path = segment_path(os.getppid(), os.getpid(), self._generation)
        return SlotArena(path, *self._slots, create=True)

    async def _maintain(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, channel = await loop.create_unix_connection(
                    lambda: wire.FrontChannel(self._on_frame, self._lost, self._frame_limit),
                    self.socket_path,
                )
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            if self._generation:
                # A fresh file per connection: an engine that outlived a broken connection can
                # never write into a slot this side has given to a new request since.
                try:
                    fresh = self._new_arena()
                except OSError:
                    log.exception("could not make a new slot file; retrying")
                    channel.close()
                    await asyncio.sleep(RECONNECT_S)
                    continue
                self.arena.close(unlink=True)
                self.arena = fresh
            self._generation += 1
            self._channel = channel
            arena = self.arena
            channel.send(
                {
                    "t": "hello",
                    "pid": os.getpid(),
                    "path": str(arena.path),
                    "count": arena.count,
                    "slot_bytes": arena.slot_bytes,
                }
            )
            try:
                await channel.closed
            finally:
                channel.close()
            log.error("lost the engine process; answering 503 until it is back")
            await asyncio.sleep(RECONNECT_S)

    def _lost(self) -> None:
        self.connected = False
        self._channel = None
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            # Its slots are not given back: an engine that lives on (the channel closed on a
            # bad frame) may still read them, until the batches that took their items have
            # copied them (an item another front end's request joined through the cache goes
            # on after this one is gone). The next connection has a new file.
            if not entry.future.done():
                entry.future.set_exception(NotReady(ENGINE_GONE))

    def _on_frame(self, msg: ToFront) -> None:
        self._heard = time.monotonic()
        if msg["t"] == "status":
            self.status = msg
            return
        if msg["t"] == "card":
            self.status, self.connected = msg, True
            if not self._first.done():
                self._first.set_result(None)
            return
        entry = self._pending.pop(msg["id"], None)
        if entry is None:
            return
        try:
            self._answer(entry, msg)
        except Exception:  # a frame that does not fit its request: the channel closes
            if not entry.future.done():  # out of `_pending`, `_lost` would not fail it
                entry.future.set_exception(NotReady(ENGINE_GONE))
            raise  # its slots stay out of use, as a lost connection's do
        self.arena.give_back(entry.slots)  # the engine answered: it is done with them

    def _answer(self, entry: _Pending, msg: ToFront) -> None:
        if msg["t"] == "ok" and entry.future.cancelled():  # admitted for a request gone since
            self.send({"t": "release", "ids": [msg["id"]]})
        elif msg["t"] == "done" and not entry.future.done():
            rows = self.arena.read_rows(entry.slots, msg["dim"])  # a copy: the slots go back
            entry.future.set_result(Completed(rows, msg["queue_s"], msg["compute_s"]))
        elif msg["t"] == "found" and not entry.future.done():
            found: list[np.ndarray | None] = [None] * entry.size
            hits = msg["hits"]
            rows = np.frombuffer(msg["rows"], "<f4").reshape(len(hits), msg["dim"])
            for i, index in enumerate(hits):  # indexed: iterating an array ends by raising
                found[index] = rows[i]
            entry.future.set_result(found)
        elif msg["t"] == "error" and not entry.future.done():
            entry.future.set_exception(wire.decode_error(msg["error"]))
        elif not entry.future.done():
            entry.future.set_result(None)

    def send(self, message: ToEngine) -> None:
        if self._channel is not None:
            self._channel.send(message)

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def refusal(self) -> str | None:
        """Why nothing can be sent now (not connected, or silent too long), or None. A
        channel already closing counts as lost: its frames would go nowhere."""
        channel = self._channel
        if not self.connected or channel is None or not channel.open:
            return ENGINE_GONE
        return self.silence()

    def expect(
        self, rid: int, slots: list[int] | None = None, size: int = 0
    ) -> asyncio.Future[Answer]:
        """Register for the one answer to `rid`; the slots are given back when it comes (a
        connection lost first keeps them out of use: see `_lost`)."""
        why = self.refusal()
        if why is not None:  # a silent engine would answer by the deadline at best: 503 now
            if slots:
                self.arena.give_back(slots)
            raise NotReady(why)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(future, slots or [], size)
        return future


class RemoteTicket:
    """An admission held in the engine. Released there when its run starts; `release_all`
    gives it back if the request ends before (a decode failed, the client went away)."""

    def __init__(self, link: EngineLink, rid: int) -> None:
        self.link = link
        self.ids = [rid]  # more than one once it has absorbed another
        self.settled = False

    def release_all(self) -> None:
        if not self.settled:
            self.settled = True
            self.link.send({"t": "release", "ids": self.ids})

    def absorb(self, other: RemoteTicket) -> None:
        self.ids.extend(other.ids)
        other.settled = True


class RemoteTower:
    """One of the engine's towers, as this front end's pipeline and probes see it."""

    def __init__(self, link: EngineLink, kind: TowerKind) -> None:
        self.link = link
        self.kind = kind

    @property
    def workers(self) -> list[WorkerStatus]:
        """Readiness: every worker dead while the engine is not connected or silent."""
        if not self.link.connected:
            return [WorkerStatus("engine", self.kind, False, "engine process not connected")]
        return worker_statuses(self.link.snapshot(), self.kind)

    @property
    def alive(self) -> bool:
        """Liveness: a silent engine is the supervisor's to replace, so this stays true until
        that should have happened (`EngineLink.gone`)."""
        if self.link.gone:
            return False
        return any(w.alive for w in worker_statuses(self.link.status, self.kind))

    def depth(self) -> int:
        return self.link.status["depth"].get(self.kind, 0)

    async def reserve(self, n: int, deadline: float) -> RemoteTicket:
        rid = self.link.next_id()
        future = self.link.expect(rid)
        wait_s = deadline - time.perf_counter()
        self.link.send({"t": "admit", "id": rid, "tower": self.kind, "n": n, "wait_s": wait_s})
        try:
            await future
        except asyncio.CancelledError:
            # Admitted in the same loop iteration as this request's cancellation: the places
            # are held in the engine and nobody holds the ticket; give them back.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.link.send({"t": "release", "ids": [rid]})
            raise
        return RemoteTicket(self.link, rid)

    async def lookup(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """The engine's cached rows for `keys` (one round trip; nothing is admitted)."""
        rid = self.link.next_id()
        future = self.link.expect(rid, size=len(keys))
        self.link.send({"t": "lookup", "id": rid, "tower": self.kind, "keys": list(keys)})
        found = await future
        assert isinstance(found, list)
        return found

    async def run(
        self,
        ticket: RemoteTicket,
        arrays: Sequence[np.ndarray],
        *,
        normalize: bool,
        request_id: str,
        keys: Sequence[bytes] | None = None,
        fresh: bool = False,
    ) -> Completed:
        first = arrays[0]
        if any(a.dtype != first.dtype for a in arrays):
            raise ValueError("a request's items must share one dtype")
        shapes = [list(a.shape) for a in arrays]  # JPEG bytes (--decode gpu) differ in length
        why = self.link.refusal()
        if why is not None:  # before any slot is taken: the file may be a lost connection's
            raise NotReady(why)
        slots = self.link.arena.take(len(arrays))  # Overloaded when none are left
        try:
            for slot, array in zip(slots, arrays, strict=True):
                self.link.arena.write(slot, array)
        except BaseException:  # an array that does not fit its slot: nothing was sent
            self.link.arena.give_back(slots)
            raise
        rid = ticket.ids[0]
        future = self.link.expect(rid, slots)
        ticket.settled = True  # the engine releases the admission as the items start
        frame: RunFrame = {
            "t": "run",
            "id": rid,
            "ids": ticket.ids,
            "tower": self.kind,
            "slots": slots,
            "dtype": first.dtype.str,
            "shapes": shapes,
            "normalize": normalize,
            "rid": request_id,
        }
        if keys is not None:  # left out when unused: each field is packed and unpacked
            frame["keys"] = list(keys)
        if fresh:
            frame["fresh"] = True
        self.link.send(frame)
        try:
            completed = await future
        except asyncio.CancelledError:
            self.link.send({"t": "cancel", "id": rid})  # slots free once it answers
            raise
        assert isinstance(completed, Completed)  # a run is answered by `done` (or `error`)
        return completed


if TYPE_CHECKING:

    def _is_a_tower(tower: RemoteTower) -> CachingTower[RemoteTicket]:
        return tower  # mypy checks that RemoteTower satisfies the pipeline's Tower protocol
