"""The engine driven over its control channel, as a front end drives it (no HTTP, no processes)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from clipserve.engine.service import EngineService
from clipserve.engine.slots import SlotArena
from clipserve.engine.wire import Channel
from clipserve.inference.runtime import build_runtime
from clipserve.metrics import Metrics
from tests.helpers import make_config, random_pixels


def test_a_run_cancelled_in_the_same_read_is_answered_and_gives_back_its_place(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A client that goes away just after its request was sent: the front end's `run` and
    `cancel` reach the engine in one read. The run must still get its one answer (the front end
    frees its slots on it) and its queue place must come back."""
    config = make_config(
        tiny_config, tiny_checkpoint, backend="fake", backend_option=["latency_ms=100"]
    )
    runtime = build_runtime(config)
    sock = tmp_path / "engine.sock"
    arena = SlotArena(tmp_path / "slots", 4, 3 * 224 * 224 * 4, create=True)

    async def main() -> None:
        service = EngineService(runtime, Metrics())
        stop, ready = asyncio.Event(), asyncio.Event()
        serving = asyncio.create_task(service.serve(sock, ready.set, stop))
        await ready.wait()
        frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        _, channel = await loop.create_unix_connection(
            lambda: Channel(frames.put_nowait), str(sock)
        )

        async def answer() -> dict[str, Any]:
            while (frame := await frames.get())["t"] == "status":
                pass
            return frame

        channel.send(
            {
                "t": "hello",
                "pid": 1,
                "path": str(arena.path),
                "count": arena.count,
                "slot_bytes": arena.slot_bytes,
            }
        )
        assert (await answer())["t"] == "card"
        async with asyncio.timeout(10):
            for rid in (1, 2):
                channel.send({"t": "admit", "id": rid, "tower": "image", "n": 1, "wait_s": 10})
                assert await answer() == {"t": "ok", "id": rid}
                arena.write(rid, random_pixels(rid))
                run = {
                    "t": "run",
                    "id": rid,
                    "ids": [rid],
                    "tower": "image",
                    "slots": [rid],
                    "dtype": "|u1",
                    "shapes": [[224, 224, 3]],
                    "normalize": True,
                    "rid": "r",
                }
                channel.send(run)
                if rid == 1:
                    channel.send({"t": "cancel", "id": rid})  # the same write as the run
                reply = await answer()
                assert reply["id"] == rid
                if rid == 1:
                    assert reply["t"] == "error"
                else:
                    assert reply["t"] == "done"
                    row = arena.view(rid, "<f4", (reply["dim"],))
                    assert abs(float(np.linalg.norm(row)) - 1) < 1e-5
        assert service.towers is not None
        assert service.towers.image.admission.used == 0
        channel.close()
        stop.set()
        await serving

    try:
        asyncio.run(main())
    finally:
        runtime.close()
        arena.close(unlink=True)
