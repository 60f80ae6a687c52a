"""The engine's CPU per request over its control channel, no HTTP: what the process hop costs
on the engine's side (issue 23), measured without the front ends' HTTP work beside it.

The engine (`EngineService`, fake backend with compute=0, cache off) runs in a process of its
own pinned to the first core; a driver pinned to the last acts as front ends with the real
`EngineLink` and `RemoteTower`: `--connections` requests in flight, each one 150 KB uint8
image admitted, run through its slot and released, as the pipeline does. Reported per round:
the engine's CPU per request (all its threads, and its busiest two), and the requests/s.

Trees measured side by side in interleaved rounds (order rotated), each imported from its
own checkout (`--tree name=path`; a `git worktree` of the commit before, say):

    git worktree add /tmp/before HEAD~1
    python -m bench.engine_link --tree before=/tmp/before --rounds 9 --out out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Pinned apart (the driver's work is not the engine's): the first core and the last.
CPUS = sorted(os.sched_getaffinity(0))
ENGINE_CPU, DRIVER_CPU = CPUS[0], CPUS[-1]


def _flags(model: Path) -> list[str]:
    return [
        *("--backend", "fake", "--pretrained", "none", "--model", str(model), "--gpus", "cpu"),
        *("--backend-option", "compute=0", "--cache-mb", "0"),
    ]


def _config(model: Path) -> Any:
    from clipserve.cli import build_parser
    from clipserve.config import load_config

    return load_config(vars(build_parser().parse_args(_flags(model))))


def _engine(model: Path, socket_path: str, ready: Any) -> None:
    """The engine process, as `engine_main` serves (uvloop, the collector's threshold)."""
    import gc

    import uvloop

    from clipserve.engine.service import EngineService, model_card
    from clipserve.inference.runtime import build_runtime
    from clipserve.metrics import Metrics

    os.sched_setaffinity(0, {ENGINE_CPU})
    gc.set_threshold(10_000)
    runtime = build_runtime(_config(model))

    async def main() -> None:
        service = EngineService(runtime, Metrics())
        card = model_card(runtime)  # what the driver's link needs, as a front end gets it
        await service.serve(Path(socket_path), lambda: ready.send(card), asyncio.Event())

    uvloop.run(main())


async def _drive(
    model: Path, card: Any, socket_path: str, engine_pid: int, seconds: float, connections: int
) -> dict[str, Any]:
    import numpy as np
    import psutil  # type: ignore[import-untyped]

    from clipserve.engine.remote import EngineLink, RemoteTower

    link = EngineLink(socket_path, _config(model), card)
    await link.start(60)
    tower = RemoteTower(link, "image")
    image = np.random.default_rng(0).integers(0, 255, (224, 224, 3), np.uint8)
    engine = psutil.Process(engine_pid)
    done = 0
    until = 0.0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < until:
            ticket = await tower.reserve(1, time.perf_counter() + 10)
            try:
                await tower.run(ticket, [image], normalize=True, request_id="bench")
            finally:
                ticket.release_all()
            done += 1

    def threads() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in engine.threads()}

    row: dict[str, Any] = {}
    for span in (1.0, seconds):  # a warm-up, then the measured point
        done, until = 0, time.monotonic() + span
        before, t0 = threads(), time.monotonic()
        await asyncio.gather(*(client() for _ in range(connections)))
        after, wall = threads(), time.monotonic() - t0
        per_thread = sorted((after[k] - before.get(k, 0.0) for k in after), reverse=True)
        row = {
            "requests": done,
            "requests_per_s": round(done / wall, 1),
            "engine_cpu_us_per_request": round(sum(per_thread) / done * 1e6, 2),
            "busiest_threads_us_per_request": [round(s / done * 1e6, 2) for s in per_thread[:2]],
        }
    await link.close()
    return row


def one(seconds: float, connections: int) -> dict[str, Any]:
    """One measurement of the tree this process imports clipserve from."""
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        from clipserve.loadgen.procs import TINY_CONFIG

        model = Path(tmp) / "fake-512.json"
        model.write_text(json.dumps({**TINY_CONFIG, "embed_dim": 512}))
        socket_path = str(Path(tmp) / "engine.sock")
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        engine = ctx.Process(target=_engine, args=(model, socket_path, theirs), daemon=True)
        engine.start()
        try:
            if not ours.poll(300):
                raise RuntimeError("the engine did not start")
            card = ours.recv()
            os.sched_setaffinity(0, {DRIVER_CPU})
            assert engine.pid is not None
            drive = _drive(model, card, socket_path, engine.pid, seconds, connections)
            return uvloop.run(drive)
        finally:
            engine.terminate()
            engine.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="name=path (repeatable)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--out", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.seconds, a.connections)))
        return
    from bench.common import machine, rotated, say, spread, utc_now, write_report

    trees = {"this": REPO} | {n: Path(t) for n, t in (x.split("=", 1) for x in a.tree)}
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for name in rotated(list(trees), r):
            env = {**os.environ, "PYTHONPATH": f"{trees[name]}{os.pathsep}{REPO}"}
            argv = [sys.executable, __file__, "--one", "--seconds", str(a.seconds)]
            argv += ["--connections", str(a.connections)]
            out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            row = {"round": r, "tree": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            say(json.dumps(row))
            rows.append(row)

    def of(name: str, key: str) -> list[float]:
        return [float(x[key]) for x in rows if x["tree"] == name]

    summary = {
        n: {k: spread(of(n, k), 2) for k in ("engine_cpu_us_per_request", "requests_per_s")}
        for n in trees
    }
    paired = {
        f"{n} / this": spread(
            [
                b["engine_cpu_us_per_request"] / t["engine_cpu_us_per_request"]
                for t in rows
                if t["tree"] == "this"
                for b in rows
                if b["tree"] == n and b["round"] == t["round"]
            ],
            3,
        )
        for n in trees
        if n != "this"
    }
    write_report(
        {
            "benchmark": "engine_link",
            "when": utc_now(),
            "machine": machine(),
            "pinning": {"engine_cpus": [ENGINE_CPU], "driver_cpus": [DRIVER_CPU]},
            "payload": "one 224x224x3 uint8 image (150 KB) per request, through a slot",
            "backend": "fake, compute=0, cache off",
            "connections": a.connections,
            "seconds_per_point": a.seconds,
            "rounds": a.rounds,
            "trees": {n: str(t) for n, t in trees.items()},
            "summary_medians": summary,
            "paired_engine_cpu": paired,
            "rows": rows,
        },
        a.out,
    )


if __name__ == "__main__":
    main()
