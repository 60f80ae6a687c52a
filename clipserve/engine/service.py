"""The engine process: the model, the towers' Batchers and the device workers, serving front
ends over the control channel. Admission is global because it happens here, once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from clipserve import collector
from clipserve.batching import Batcher, Ticket, TowerKind
from clipserve.batching.batcher import Run
from clipserve.config import ServerConfig
from clipserve.engine import wire
from clipserve.engine.heartbeat import (
    Busy,
    HeartbeatWriter,
    busiest,
    heartbeat_path,
    keep_beating,
)
from clipserve.engine.messages import (
    AdmitFrame,
    DoneFrame,
    EngineReady,
    LookupFrame,
    ModelCard,
    RunFrame,
    StatusFrame,
    ToEngine,
    ToFront,
)
from clipserve.engine.slots import SlotArena
from clipserve.errors import ClipserveError, NotReady, StartupError
from clipserve.inference.runtime import Runtime
from clipserve.inference.towers import Towers
from clipserve.metrics import Metrics

log = logging.getLogger(__name__)
STATUS_INTERVAL_S = 0.25


def model_card(runtime: Runtime) -> ModelCard:
    """What a front end needs to know of the model to parse, decode and tokenise for it."""
    model, spec = runtime.model, runtime.model.preprocess
    return {
        "name": model.name,
        "weights_id": model.weights_id,
        "embed_dim": model.embed_dim,
        "context_length": model.context_length,
        "preprocess": {
            "size": list(spec.size),
            "mean": list(spec.mean),
            "std": list(spec.std),
            "interpolation": spec.interpolation,
            "resize_mode": spec.resize_mode,
        },
        "backend": runtime.backend,
        "devices": runtime.devices,
        "precision": runtime.precision,
        "batching": dataclasses.asdict(runtime.config.batching),
        "self_check": runtime.self_check,
    }


@dataclass(eq=False, slots=True)
class Started:
    """A run under way: whoever takes it out of `FrontEnd.runs` gives its one answer."""

    run: Run
    ticket: Ticket
    msg: RunFrame


@dataclass(eq=False)
class FrontEnd:
    """One connected front end: its slots, the admissions it holds and the runs under way."""

    channel: wire.EngineChannel | None = None
    arena: SlotArena | None = None
    pid: int = 0
    tickets: dict[int, Ticket] = field(default_factory=dict)
    runs: dict[int, Started] = field(default_factory=dict)

    def send(self, message: ToFront) -> None:
        if self.channel is not None:
            self.channel.send(message)

    def error(self, rid: int, error: BaseException) -> None:
        self.send({"t": "error", "id": rid, "error": wire.encode_error(error)})


class EngineService:
    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.front_ends: set[FrontEnd] = set()
        self._none_connected = asyncio.Event()
        self._none_connected.set()
        self.towers: Towers | None = None

    def _batcher(self, tower: TowerKind) -> Batcher:
        assert self.towers is not None
        if tower == "image":
            return self.towers.image
        if tower == "text":
            return self.towers.text
        raise ValueError(f"unknown tower {tower!r}")  # a frame's value, not checked on arrival

    async def serve(
        self, socket_path: Path, on_ready: Callable[[], object], stop: asyncio.Event
    ) -> None:
        self.towers = Towers.build(self.runtime, self.metrics)
        self.towers.start()
        await asyncio.to_thread(socket_path.unlink, missing_ok=True)  # a dead engine's
        server = await asyncio.get_running_loop().create_unix_server(
            self._connection, path=str(socket_path)
        )
        pusher = asyncio.create_task(self._push_status())
        beats = HeartbeatWriter(heartbeat_path(socket_path.parent, os.getpid()))
        beating = asyncio.create_task(keep_beating(beats, self._busiest))
        runtime = self.runtime
        devices = ", ".join(runtime.devices)
        log.info(
            "engine serving %s with %s on %s", runtime.model.identity, runtime.backend, devices
        )
        on_ready()
        try:
            with collector.serving():  # as in the app
                await stop.wait()
        finally:
            pusher.cancel()
            beating.cancel()
            beats.close()
            server.close()
            channels = [f.channel for f in self.front_ends if f.channel is not None]
            for channel in channels:
                channel.close()  # connection_lost drops the front end
            await asyncio.gather(*(c.closed for c in channels))
            await self.towers.stop()

    async def drain(self, stop: asyncio.Event, timeout_s: float) -> None:
        """On SIGTERM: stop once the front ends, draining their own requests through this
        engine, have gone (the supervisor stops them first; a SIGTERM sent to the whole group,
        as systemd does, must not take the engine from under them), or after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._none_connected.wait()
        stop.set()

    def _busiest(self) -> Busy | None:
        """The device worker due soonest, for the heartbeat: a batch is due its measured time
        plus --heartbeat-timeout-s; before any is measured, the request deadline's worth (a
        batch that outlasts it can answer none of its requests anyway)."""
        assert self.towers is not None
        config = self.runtime.config
        workers = [*self.towers.image.workers, *self.towers.text.workers]
        return busiest(workers, config.http.heartbeat_timeout_s, config.limits.request_timeout_s)

    async def _push_status(self) -> None:
        assert self.towers is not None
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            if self.front_ends:
                status: StatusFrame = {"t": "status", **self.towers.status()}
                for front in self.front_ends:
                    front.send(status)

    def _connection(self) -> wire.EngineChannel:
        """A new front end's channel (the server's protocol factory)."""
        front = FrontEnd()
        front.channel = wire.EngineChannel(
            lambda message: self._dispatch(front, message), lambda: self._drop(front)
        )
        self.front_ends.add(front)
        self._none_connected.clear()
        return front.channel

    def _drop(self, front: FrontEnd) -> None:
        """Cancel a gone front end's runs (its queued items leave the queue) and give back its
        admissions; its slot file is the supervisor's to remove."""
        front.channel = None
        self.front_ends.discard(front)
        if not self.front_ends:
            self._none_connected.set()
        runs, front.runs = front.runs, {}
        for started in runs.values():  # nobody reads their answers: queued items leave now
            started.run.leave()
            started.ticket.release_all()
        for ticket in front.tickets.values():
            ticket.release_all()
        front.tickets.clear()
        if runs or front.arena is not None:
            log.info("front end %d gone: %d runs cancelled", front.pid, len(runs))
        if front.arena is not None:
            # Closes the file descriptor now, so tmpfs frees the pages once the name is gone;
            # the mapping goes with the last item view still computing.
            front.arena.close()
            front.arena = None

    def _dispatch(self, front: FrontEnd, msg: ToEngine) -> None:
        if msg["t"] == "admit":
            self._admit(front, msg)
        elif msg["t"] == "run":
            self._start_run(front, msg)
        elif msg["t"] == "release":
            for held in (front.tickets.pop(i, None) for i in msg["ids"]):
                if held is not None:
                    held.release_all()
        elif msg["t"] == "cancel":
            self._cancel(front, msg["id"])
        elif msg["t"] == "lookup":
            self._lookup(front, msg)
        elif msg["t"] == "hello":
            front.pid = msg["pid"]
            front.arena = SlotArena(
                Path(msg["path"]), msg["count"], msg["slot_bytes"], create=False
            )
            assert self.towers is not None
            front.send({"t": "card", **model_card(self.runtime), **self.towers.status()})
        else:  # a frame of a newer or older clipserve: the channel closes
            raise ValueError(f"unknown control frame {msg.get('t')!r}")

    def _admit(self, front: FrontEnd, msg: AdmitFrame) -> None:
        rid = msg["id"]
        try:
            deadline = time.perf_counter() + msg["wait_s"]
            front.tickets[rid] = self._batcher(msg["tower"]).admit(msg["n"], deadline)
        except ClipserveError as e:
            front.error(rid, e)
        else:
            front.send({"t": "ok", "id": rid})

    def _lookup(self, front: FrontEnd, msg: LookupFrame) -> None:
        """Rows from the cache go back in the frame itself: a few KiB each, no slot needed."""
        rows = self._batcher(msg["tower"]).cached(msg["keys"])
        hits = [i for i, row in enumerate(rows) if row is not None]
        found = [row for row in rows if row is not None]
        front.send(
            {
                "t": "found",
                "id": msg["id"],
                "hits": hits,
                "dim": int(found[0].shape[0]) if found else 0,
                "rows": b"".join(row.astype("<f4", copy=False).tobytes() for row in found),
            }
        )

    def _start_run(self, front: FrontEnd, msg: RunFrame) -> None:
        """The items from their slots into the batcher; answered by `_ran` from the run's done
        callback (no task per run: a task costs ~5 µs of the engine's loop a request)."""
        rid = msg["id"]
        tickets = [front.tickets.pop(i, None) for i in msg["ids"]]
        ticket = tickets[0]
        for other in tickets[1:]:
            if ticket is not None and other is not None:
                ticket.absorb(other)
        arena = front.arena
        if ticket is None or arena is None or None in tickets:
            for held in tickets:
                if held is not None:
                    held.release_all()
            front.error(rid, NotReady("engine has no admission for this request; retry"))
            return
        try:
            arrays = [
                arena.view(slot, msg["dtype"], tuple(shape))
                for slot, shape in zip(msg["slots"], msg["shapes"], strict=True)
            ]
            run = self._batcher(msg["tower"]).submit(
                ticket,
                arrays,
                normalize=msg["normalize"],
                request_id=msg["rid"],
                keys=msg.get("keys"),
                fresh=msg.get("fresh", False),
            )
        except Exception as e:
            ticket.release_all()
            self._failed(front, msg, e)
            return
        started = front.runs[rid] = Started(run, ticket, msg)
        if run.gathering.pending:
            run.future.add_done_callback(functools.partial(self._ran, front, started))
        else:  # every item was in the cache
            self._ran(front, started)

    def _ran(self, front: FrontEnd, started: Started, _: object = None) -> None:
        """A run's one answer once its items are: the rows into its slots, then `done`."""
        msg = started.msg
        if front.runs.get(msg["id"]) is not started:  # cancelled, or its front end gone
            return
        del front.runs[msg["id"]]
        run, future = started.run, started.run.future
        error: BaseException | None = None
        if future.done():  # else the run had no items to wait for
            error = NotReady("cancelled") if future.cancelled() else future.exception()
        if error is not None:
            self._end(front, started, run.located(error))
            return
        started.ticket.release_all()
        try:  # a callback's exception would reach only the loop's log: answer it instead
            completed = run.completed()
            rows = completed.embeddings
            arena = front.arena
            assert arena is not None  # a front end's runs end with its arena
            arena.write_rows(msg["slots"], rows)
            done: DoneFrame = {
                "t": "done",
                "id": msg["id"],
                "dim": int(rows.shape[1]),
                "queue_s": completed.queue_s,
                "compute_s": completed.compute_s,
            }
        except Exception as e:
            self._failed(front, msg, e)
            return
        front.send(done)  # after the last write into its slots: reusable now

    def _cancel(self, front: FrontEnd, rid: int) -> None:
        """The client went away: the run ends now, with an error for its one answer."""
        started = front.runs.pop(rid, None)
        if started is not None:
            self._end(front, started, NotReady("cancelled"))

    def _end(self, front: FrontEnd, started: Started, error: BaseException) -> None:
        """A failed or cancelled run (out of `runs`): its queued items leave, its admission
        goes back, and its answer waits for any item still reading its slots that another
        request's run shares through the cache, since the front end reuses them once answered.
        An item only this run waits for may still be read after the answer (a batch already
        taken copies it): what it computes from the slot's next contents is never read."""
        reading = started.run.leave()
        started.ticket.release_all()
        msg = started.msg
        if not reading:
            self._failed(front, msg, error)
            return
        waiting = asyncio.gather(*reading, return_exceptions=True)
        waiting.add_done_callback(lambda _: self._failed(front, msg, error))

    def _failed(self, front: FrontEnd, msg: RunFrame, error: BaseException) -> None:
        if not isinstance(error, ClipserveError):
            log.error("run %s from front end %d failed", msg["rid"], front.pid, exc_info=error)
        front.error(msg["id"], error)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed (uvicorn[standard] brings it), as the front ends run."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _tell(ready: Connection, message: EngineReady) -> None:
    ready.send(message)


def engine_main(
    config: ServerConfig, socket_path: str, ready: Connection, supervisor_pid: int
) -> None:
    """The engine process's entry: build, warm up, tell the supervisor, serve until SIGTERM."""
    from clipserve.engine.child import start_child
    from clipserve.inference.runtime import build_runtime

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the
    # supervisor drains the front ends first, then stops the engine with SIGTERM.
    start_child(config.http.log_level, "engine", supervisor_pid, config.http.log_format)
    try:
        runtime = build_runtime(config)
    except StartupError as e:
        _tell(ready, ("error", str(e)))
        os._exit(2)
    try:
        card = model_card(runtime)

        async def main() -> None:
            stop = asyncio.Event()
            service = EngineService(runtime, Metrics())
            draining: set[asyncio.Task[None]] = set()

            def on_sigterm() -> None:
                if not draining:
                    stopping = service.drain(stop, config.http.stop_limit_s)
                    draining.add(asyncio.create_task(stopping))

            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
            await service.serve(Path(socket_path), lambda: _tell(ready, ("ready", card)), stop)

        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(main())
    finally:
        with contextlib.suppress(Exception):
            runtime.close()
        logging.shutdown()
        os._exit(0)  # skips interpreter teardown: extension modules' exit-time noise
