"""`--workers 2` with the embedding cache on, under clients that give up. Requests for the same
new images arrive together, so the engine merges them into one item in flight, and half of
the requests are abandoned after a few milliseconds (a `cancel` to the engine when their run is
under way); one image in four makes the fake model answer NaN. Every answer that comes must be
a unit row or, for those images, 422 `non_finite_embedding`; nothing may be logged at error
(an item's failure that nobody reads is one); afterwards the queue must be empty and every image
served."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from clipserve.loadgen.procs import free_port
from tests.engine.test_workers_served import stop_tree
from tests.helpers import until_checked

SECONDS = 6
CLIENTS = 32
HEADERS = {
    "Content-Type": "application/octet-stream",
    "X-Tensor-Dtype": "uint8",
    "X-Tensor-Shape": "1,224,224,3",
}


NAN_PIXEL = 7  # the fake model's NaN for an image whose first value is this


def _image(seed: int, nan: bool = False) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (224, 224, 3), np.uint8)
    pixels[0, 0, 0] = NAN_PIXEL if nan else NAN_PIXEL + 1
    return pixels.tobytes()


@pytest.mark.slow  # a multi-process server under load for several seconds
def test_cancels_amid_merged_items_log_no_error_and_leave_nothing_queued(
    tiny_config: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [
        *(sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"),
        *("--backend-option", "latency_ms=30", "--backend-option", f"nan_pixel={NAN_PIXEL}"),
        *("--model", str(tiny_config)),
        *("--pretrained", "none", "--gpus", "cpu", "--grpc-port", "0"),
        *("--host", "127.0.0.1", "--port", str(port), "--cache-mb", "16"),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    counts = {"answered": 0, "given_up": 0}

    async def one(session: aiohttp.ClientSession) -> None:
        batch = int(time.monotonic() * 20)  # new images every 50 ms: requested together
        which = random.randrange(4)
        body = _image(batch * 10 + which, nan=which == 0)
        give_up = random.choice([0.005, 0.02, 0.05, 30.0, 30.0, 30.0])
        try:
            async with session.post(
                url + "/embed", data=body, headers=HEADERS, timeout=aiohttp.ClientTimeout(give_up)
            ) as r:
                answer = json.loads(await r.read())
                if which == 0:
                    assert r.status == 422 and answer["error"]["code"] == "non_finite_embedding"
                else:
                    assert r.status == 200, answer
                    (row,) = answer["embeddings"]
                    assert abs(float(np.linalg.norm(row)) - 1) < 1e-3
                counts["answered"] += 1
        except (TimeoutError, aiohttp.ClientError):
            counts["given_up"] += 1

    async def main() -> None:
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    async with session.get(url + "/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await until_checked(ready, 120, "/readyz 200", poll_s=0.2)
            end = time.monotonic() + SECONDS
            while time.monotonic() < end:
                await asyncio.gather(*(one(session) for _ in range(CLIENTS)))
            for seed in range(3):  # served as ever once the storm is over
                async with session.post(url + "/embed", data=_image(seed), headers=HEADERS) as r:
                    assert r.status == 200

            async def drained() -> bool:
                # The front end's gauge is the engine's last status (pushed every 0.25 s): it
                # may still hold the last request's item for a push; a leaked one stays.
                async with session.get(url + "/metrics") as r:
                    return "clipserve_queue_depth 0.0" in (await r.text()).splitlines()

            await until_checked(drained, 3, "queue depth 0", poll_s=0.1)

    try:
        asyncio.run(main())
    finally:
        stop_tree(proc)
    assert counts["answered"] > 100 and counts["given_up"] > 100, counts
    lines = log.read_text().splitlines()
    errors = [line for line in lines if " ERROR " in line or "Traceback" in line]
    assert not errors, errors[:5]
