"""How long the engine takes to come back after kill -9, idle and under a retry storm.

`clipserve --workers 2 --backend fake` (the tiny model) on this machine; the engine is killed
with SIGKILL and the time is taken until the front ends' /readyz answers 200 again. Under the
storm, 64 clients that ignore Retry-After post a small JPEG in a loop the whole time, so the
front ends spend CPU answering 503 that the new engine needs to import torch, load the model
and warm up. The two variants alternate in interleaved rounds.

    python -m bench.restart_storm --out bench/results/restart-storm.json   # 5 rounds
    python -m bench.restart_storm --rounds 1                                # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import psutil

from bench.common import machine, rotated, spread, utc_now, write_report
from clipserve.loadgen.images import jpeg
from clipserve.loadgen.procs import clipserve_process, ready, tiny_model

VARIANTS = ("idle", "storm")
CLIENTS = 64


def engine_of(supervisor: int, port: int) -> psutil.Process:
    """The supervisor's spawned child that does not listen on the port (multiprocessing's
    resource tracker is a child too: not spawned by `spawn_main`)."""
    for child in psutil.Process(supervisor).children():
        if "spawn_main" not in " ".join(child.cmdline()):
            continue
        conns = child.net_connections(kind="tcp")
        if not any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return child
    raise RuntimeError("no engine process found")


@contextmanager
def storm(url: str, clients: int) -> Iterator[dict[str, int]]:
    """`clients` loops posting a JPEG with no pause, whatever the answer, until the block ends."""
    counts: dict[str, int] = {}
    stop = threading.Event()
    body = jpeg(96, 96, seed=3)

    async def loop(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            try:
                async with session.post(
                    url + "/embed", data=body, headers={"Content-Type": "image/jpeg"}
                ) as r:
                    await r.read()
                    key = str(r.status)
            except (aiohttp.ClientError, TimeoutError):
                key = "error"
            counts[key] = counts.get(key, 0) + 1

    async def clients_all() -> None:
        timeout = aiohttp.ClientTimeout(total=30)
        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await asyncio.gather(*(loop(session) for _ in range(clients)))

    thread = threading.Thread(target=asyncio.run, args=(clients_all(),), daemon=True)
    thread.start()
    try:
        time.sleep(2.0)  # the storm in full swing before the kill
        yield counts
    finally:
        stop.set()
        thread.join(60)


def one_restart(flags: list[str], load: bool) -> dict[str, object]:
    with clipserve_process(flags, startup_s=300) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(20):  # served once, so the engine's first batch is behind us
            ready(url)
        engine = engine_of(proc.pid, port)

        def restart() -> float:
            t0 = time.monotonic()
            engine.kill()
            engine.wait(30)
            while not all(ready(url) for _ in range(4)):  # both front ends, most likely
                if time.monotonic() - t0 > 300:
                    raise RuntimeError("the engine did not come back in 300 s")
                time.sleep(0.05)
            return time.monotonic() - t0

        if not load:
            return {"seconds": round(restart(), 2)}
        with storm(url, CLIENTS) as counts:
            seconds = restart()
        return {"seconds": round(seconds, 2), "answers": dict(counts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = ["--workers", "2", "--backend", "fake", "--model", str(tiny_model(Path(tmp)))]
        base += ["--pretrained", "none", "--gpus", "cpu", "--cache-mb", "0"]
        runs: dict[str, list[dict[str, object]]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for variant in rotated(VARIANTS, r):
                result = one_restart(base, load=variant == "storm")
                runs[variant].append(result)
                print(f"round {r + 1} {variant}: {result}", flush=True)
    seconds = {v: [float(str(x["seconds"])) for x in runs[v]] for v in VARIANTS}
    report = {
        "benchmark": "restart_storm",
        "when": utc_now(),
        "machine": machine(),
        "what": (
            f"--workers 2 --backend fake (tiny model): seconds from kill -9 of the engine to "
            f"/readyz 200, idle and under {CLIENTS} clients that ignore Retry-After"
        ),
        "rounds": args.rounds,
        "seconds": {v: spread(seconds[v], 2) for v in VARIANTS},
        "ratio_storm_to_idle": spread(
            [b / a for a, b in zip(seconds["idle"], seconds["storm"], strict=True)], 2
        ),
        "runs": runs,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
