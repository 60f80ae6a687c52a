"""The engine driven over its control channel, as a front end drives it (no HTTP, no processes)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from clipserve.engine import remote, wire
from clipserve.engine.remote import EngineLink, RemoteTower
from clipserve.engine.service import EngineService, model_card
from clipserve.engine.slots import SlotArena
from clipserve.engine.wire import Channel
from clipserve.errors import NotReady
from clipserve.inference.runtime import build_runtime
from clipserve.metrics import Metrics
from tests.helpers import make_config, random_pixels

KEY = b"k" * 32  # a cache key, as the front end's are: the same image's


class Front:
    """One front end's side of the channel, frames kept in order of arrival."""

    def __init__(self, service: EngineService, arena: SlotArena) -> None:
        self.service = service
        self.arena = arena
        self.frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.channel: Channel[Any, Any]

    async def answer(self) -> dict[str, Any]:
        while (frame := await self.frames.get())["t"] == "status":
            pass
        return frame

    async def admit(self, rid: int, n: int = 1) -> None:
        self.channel.send({"t": "admit", "id": rid, "tower": "image", "n": n, "wait_s": 10})
        assert await self.answer() == {"t": "ok", "id": rid}

    def run(self, rid: int, slots: list[int], keys: list[bytes] | None = None) -> None:
        self.channel.send(
            {
                "t": "run",
                "id": rid,
                "ids": [rid],
                "tower": "image",
                "slots": slots,
                "dtype": "|u1",
                "shapes": [[224, 224, 3]] * len(slots),
                "normalize": True,
                "rid": f"r{rid}",
                "keys": keys,
            }
        )

    def used(self) -> int:
        assert self.service.towers is not None
        return self.service.towers.image.admission.used


@asynccontextmanager
async def engine_front(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path, **flags: Any
) -> AsyncIterator[Front]:
    """A served engine (fake backend) and one front end connected to it with its slots."""
    config = make_config(tiny_config, tiny_checkpoint, backend="fake", **flags)
    runtime = build_runtime(config)
    sock = tmp_path / "engine.sock"
    arena = SlotArena(tmp_path / "slots", 4, 3 * 224 * 224 * 4, create=True)
    try:
        service = EngineService(runtime, Metrics())
        stop, ready = asyncio.Event(), asyncio.Event()
        serving = asyncio.create_task(service.serve(sock, ready.set, stop))
        await ready.wait()
        front = Front(service, arena)
        loop = asyncio.get_running_loop()
        _, front.channel = await loop.create_unix_connection(
            lambda: Channel(front.frames.put_nowait), str(sock)
        )
        hello = {"pid": 1, "path": str(arena.path), "count": 4, "slot_bytes": arena.slot_bytes}
        front.channel.send({"t": "hello", **hello})
        assert (await front.answer())["t"] == "card"
        async with asyncio.timeout(10):
            yield front
        front.channel.close()
        stop.set()
        await serving
    finally:
        runtime.close()
        arena.close(unlink=True)


def test_a_run_cancelled_in_the_same_read_is_answered_and_gives_back_its_place(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A client that goes away just after its request was sent: the front end's `run` and
    `cancel` reach the engine in one read. The run must still get its one answer (the front end
    frees its slots on it) and its queue place must come back."""

    async def main() -> None:
        options = {"backend_option": ["latency_ms=100"]}
        async with engine_front(tiny_config, tiny_checkpoint, tmp_path, **options) as front:
            for rid in (1, 2):
                await front.admit(rid)
                front.arena.write(rid, random_pixels(rid))
                front.run(rid, [rid])
                if rid == 1:
                    front.channel.send({"t": "cancel", "id": rid})  # the same write as the run
                reply = await front.answer()
                assert reply["id"] == rid
                if rid == 1:
                    assert reply["t"] == "error"
                else:
                    assert reply["t"] == "done"
                    row = front.arena.view(rid, "<f4", (reply["dim"],))
                    assert abs(float(np.linalg.norm(row)) - 1) < 1e-5
            assert front.used() == 0

    asyncio.run(main())


@pytest.mark.parametrize("fails", [False, True], ids=["computed", "failed"])
def test_a_cancelled_run_whose_item_another_run_shares_is_answered_once_that_item_is_done(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path, caplog: Any, fails: bool
) -> None:
    """Run 1's item computes; run 2 joins it through the cache (the same key); run 1 is
    cancelled. Its item is still reading run 1's slot, which the front end reuses as soon as
    run 1 is answered, so the answer (an error) waits for the batch; run 2 gets the row, or
    the item's own error, and nothing is left unread for asyncio to complain of."""
    caplog.set_level(logging.ERROR)

    async def main() -> None:
        options = {"backend_option": ["latency_ms=400", "nan_pixel=7"], "cache_mb": 16}
        async with engine_front(tiny_config, tiny_checkpoint, tmp_path, **options) as front:
            pixels = random_pixels(1)
            pixels[0, 0, 0] = 7 if fails else 8
            front.arena.write(1, pixels)
            front.arena.write(2, pixels)
            await front.admit(1)
            front.run(1, [1], [KEY])
            assert front.service.towers is not None
            while front.service.towers.image.workers[0].running is None:  # noqa: ASYNC110
                await asyncio.sleep(0.005)  # until its batch computes
            await front.admit(2)
            front.run(2, [2], [KEY])
            front.channel.send({"t": "cancel", "id": 1})
            cancelled_at = time.monotonic()
            replies, waited = {}, {}
            for _ in range(2):
                reply = await front.answer()
                replies[reply["id"]], waited[reply["id"]] = reply, time.monotonic() - cancelled_at
            assert replies[1]["t"] == "error" and replies[1]["error"]["message"] == "cancelled"
            assert waited[1] > 0.15  # the batch's remaining ~0.4 s, not at once
            if fails:
                assert replies[2]["t"] == "error"
                assert replies[2]["error"]["cls"] == "NonFiniteEmbedding"
            else:
                assert replies[2]["t"] == "done"
                row = front.arena.view(2, "<f4", (replies[2]["dim"],))
                assert abs(float(np.linalg.norm(row)) - 1) < 1e-5
            assert front.used() == 0

    asyncio.run(main())
    gc.collect()  # a future whose exception nobody read says so as it is collected
    assert not [r.getMessage() for r in caplog.records], "logged errors"


def test_a_gone_front_ends_runs_give_back_their_places_and_a_bad_slot_is_answered(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A run naming a slot outside the file gets one error answer. A front end that
    disconnects with runs queued and computing (keyed and not) leaves no place held."""

    async def main() -> None:
        options = {"backend_option": ["latency_ms=300"], "cache_mb": 16, "max_batch_size": 1}
        async with engine_front(tiny_config, tiny_checkpoint, tmp_path, **options) as front:
            await front.admit(1)
            front.run(1, [99])
            reply = await front.answer()
            assert reply["t"] == "error" and reply["id"] == 1
            assert front.used() == 0
            for slot in range(4):
                front.arena.write(slot, random_pixels(slot))
            await front.admit(2)
            front.run(2, [1], [KEY])
            await front.admit(3)
            front.run(3, [2])
            await front.admit(4, n=2)
            front.run(4, [0, 3])
            await asyncio.sleep(0.05)
            (engine_side,) = front.service.front_ends
            assert len(engine_side.runs) == 3 and front.used() == 3  # one computes, 3 queued
            front.channel.close()
            while front.service.front_ends:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            assert front.used() == 0

    asyncio.run(main())


def test_a_run_the_cache_answers_whole_is_done_at_once_and_an_items_error_names_it(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A run whose every item the cache holds has nothing to wait for: its rows are written
    and it is answered without reaching the queue. An item whose embedding is not finite
    fails its run with its index in the message; the places come back either way."""

    async def main() -> None:
        options = {"backend_option": ["nan_pixel=7"], "cache_mb": 16}
        async with engine_front(tiny_config, tiny_checkpoint, tmp_path, **options) as front:
            front.arena.write(0, random_pixels(1))
            for rid in (1, 2):  # computed, then found
                await front.admit(rid)
                front.run(rid, [0], [KEY])
                reply = await front.answer()
                assert reply["t"] == "done" and reply["id"] == rid
            assert reply["queue_s"] == 0 and reply["compute_s"] == 0
            bad = random_pixels(2)
            bad[0, 0, 0] = 7
            front.arena.write(1, random_pixels(3))
            front.arena.write(2, bad)
            await front.admit(3, n=2)
            front.run(3, [1, 2])
            reply = await front.answer()
            assert reply["t"] == "error" and reply["id"] == 3
            assert reply["error"]["message"].startswith("item 1: ")
            assert front.used() == 0

    asyncio.run(main())


@asynccontextmanager
async def linked(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> AsyncIterator[tuple[EngineLink, RemoteTower]]:
    """A served engine (fake backend, 300 ms a batch) and a real front end's link to it."""
    config = make_config(
        tiny_config, tiny_checkpoint, backend="fake", backend_option=["latency_ms=300"]
    )
    runtime = build_runtime(config)
    sock = tmp_path / "engine.sock"
    link: EngineLink | None = None
    try:
        service = EngineService(runtime, Metrics())
        stop, ready = asyncio.Event(), asyncio.Event()
        serving = asyncio.create_task(service.serve(sock, ready.set, stop))
        await ready.wait()
        link = EngineLink(str(sock), config, model_card(runtime))
        await link.start(10)
        async with asyncio.timeout(10):
            yield link, RemoteTower(link, "image")
        stop.set()
        await serving
    finally:
        if link is not None:
            await link.close()
        runtime.close()


@pytest.mark.parametrize("how", ["closed", "bad frame"])
def test_a_lost_connections_slots_are_never_handed_out_again(
    tiny_config: Path,
    tiny_checkpoint: Path,
    tmp_path: Path,
    how: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The front end's channel can close while the engine lives on (a bad frame either way).
    Until the engine sees it, it may still read the slots of runs under way (and copy an item
    another front end's request joined through the cache): the front end must not write a
    new request's item into them. Its runs fail NotReady at once, the one a bad answer was
    for too; later requests are refused before they take a slot."""

    monkeypatch.setattr(remote, "RECONNECT_S", 60.0)  # no new file while the test looks

    async def main() -> None:
        async with linked(tiny_config, tiny_checkpoint, tmp_path) as (link, tower):
            deadline = time.perf_counter() + 10
            ticket = await tower.reserve(1, deadline)
            run = asyncio.create_task(
                tower.run(ticket, [random_pixels(1)], normalize=True, request_id="r1")
            )
            await asyncio.sleep(0.05)  # its item in slot 0 (lowest first), computing
            later = await tower.reserve(1, deadline)  # admitted before the loss
            assert link._channel is not None
            if how == "closed":
                link._channel.close()  # as `Channel.data_received` does on a bad frame
            else:  # an answer to the run that does not fit it: a row longer than a slot
                bad = {"t": "done", "id": ticket.ids[0], "dim": 1 << 20}
                times = {"queue_s": 0.0, "compute_s": 0.0}
                link._channel.data_received(msgpack.packb({**bad, **times}))
            with pytest.raises(NotReady):
                await run
            free = link.arena.free
            with pytest.raises(NotReady):
                await tower.run(later, [random_pixels(2)], normalize=True, request_id="r2")
            assert link.arena.free == free  # refused before taking a slot,
            assert not link.arena.view(1, np.uint8, (224, 224, 3)).any()  # or writing one
            assert link.arena.take(1) != [0]  # the run's slot stays out of use

    asyncio.run(main())


def test_a_run_whose_item_does_not_fit_a_slot_gives_its_slots_back(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Every input is size-checked before it reaches the link; should one not fit its slot
    after all, the slots taken for the run go back and the next run is served."""

    async def main() -> None:
        async with linked(tiny_config, tiny_checkpoint, tmp_path) as (link, tower):
            free = link.arena.free
            ticket = await tower.reserve(2, time.perf_counter() + 10)
            too_large = np.zeros(link.arena.slot_bytes + 1, np.uint8)
            with pytest.raises(ValueError, match="does not fit"):
                await tower.run(
                    ticket, [random_pixels(1), too_large], normalize=True, request_id="r1"
                )
            assert link.arena.free == free
            ticket.release_all()
            ticket = await tower.reserve(1, time.perf_counter() + 10)
            done = await tower.run(ticket, [random_pixels(2)], normalize=True, request_id="r2")
            assert done.embeddings.shape[0] == 1 and link.arena.free == free

    asyncio.run(main())


def test_a_front_end_takes_the_largest_found_frame_its_limits_allow() -> None:
    """A `found` frame holds a whole request's cached rows: at --max-items-per-request 8192 and
    1024 floats a row, 34 MB. Past its channel's buffer the front end would close the channel
    (msgpack's BufferFull) and fail every request it had under way, on every such request."""
    items, dim = 8192, 1024
    rows = np.ones((items, dim), "<f4").tobytes()
    frame = {"t": "found", "id": 1, "hits": list(range(items)), "dim": dim, "rows": rows}

    async def main() -> None:
        got: list[dict[str, Any]] = []
        lost = asyncio.Event()
        ours, theirs = socket.socketpair()
        limit = wire.found_limit(items, dim)
        _, channel = await asyncio.get_running_loop().create_connection(
            lambda: wire.FrontChannel(got.append, lost.set, limit), sock=ours
        )
        data = msgpack.packb(frame) + msgpack.packb({"t": "ok", "id": 2})
        sent = asyncio.create_task(asyncio.to_thread(theirs.sendall, data))
        try:
            async with asyncio.timeout(30):
                while len(got) < 2 and not lost.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            assert not lost.is_set(), "the channel closed"
            assert got[0]["rows"] == rows and got[1] == {"t": "ok", "id": 2}
            assert channel.open
        finally:
            channel.close()
            theirs.close()
            with contextlib.suppress(OSError):  # the sender, where the channel closed first
                await sent

    asyncio.run(main())
