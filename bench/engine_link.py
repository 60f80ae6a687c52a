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

With --callgrind, the engine's instructions per request instead of its CPU time (which drifts
with this machine's speed by more than a small change saves): each tree's engine runs under
callgrind, instrumented only while the driver sends a fixed number of requests, twice (N and
4N), and the difference over 3N is its count per request, every thread of the engine included
(its timers slowed to once an hour: they are work per second, not per request). `--keep DIR`
keeps callgrind's files for `callgrind_annotate`.

    python -m bench.engine_link --callgrind --tree before=/tmp/before --requests 128
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import os
import re
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


def _config(model: Path, *flags: str) -> Any:
    from clipserve.cli import build_parser
    from clipserve.config import load_config

    return load_config(vars(build_parser().parse_args([*_flags(model), *flags])))


def _engine(model: Path, socket_path: str, ready: Any, *, timers: bool = True) -> None:
    """The engine process, as `engine_main` serves (uvloop, the collector's threshold), until
    SIGTERM; `ready` is called with the model card once it serves. Without `timers`, its
    status pushes and heartbeat stamps come once an hour: work per second, not per request,
    which a count per request must leave out (the longer of its two runs would count more)."""
    import gc
    import signal

    import uvloop

    from clipserve.engine import service as engine_service
    from clipserve.engine.heartbeat import keep_beating
    from clipserve.engine.service import EngineService, model_card
    from clipserve.inference.runtime import build_runtime
    from clipserve.metrics import Metrics

    if not timers:
        hourly = functools.partial(keep_beating, interval_s=3600.0)
        engine_service.STATUS_INTERVAL_S = 3600.0
        engine_service.keep_beating = hourly  # type: ignore[attr-defined]
    os.sched_setaffinity(0, {ENGINE_CPU})
    gc.set_threshold(10_000)
    runtime = build_runtime(_config(model))

    async def main() -> None:
        stop = asyncio.Event()  # an ordinary exit, so that callgrind reports its count
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        service = EngineService(runtime, Metrics())
        card = model_card(runtime)  # what the driver's link needs, as a front end gets it
        await service.serve(Path(socket_path), lambda: ready(card), stop)

    uvloop.run(main())


def _engine_piped(model: Path, socket_path: str, ready: Any) -> None:
    """`_engine` in a spawned process, the card sent back through a pipe."""
    _engine(model, socket_path, ready.send)


def _engine_to_file(model: Path, socket_path: str, card_path: Path) -> None:
    """`_engine` under callgrind (a command line of its own), the card written to a file."""

    def ready(card: Any) -> None:
        part = card_path.with_suffix(".part")
        part.write_text(json.dumps(card))
        part.rename(card_path)

    _engine(model, socket_path, ready, timers=False)


async def _link(
    model: Path, card: Any, socket_path: str, start_s: float, *flags: str
) -> tuple[Any, Any]:
    """A front end's link to the engine, and a coroutine function that sends one request
    through it: one 150 KB uint8 image admitted, run through its slot and released, as the
    pipeline does."""
    import numpy as np

    from clipserve.engine.remote import EngineLink, RemoteTower

    link = EngineLink(socket_path, _config(model, *flags), card)
    await link.start(start_s)
    tower = RemoteTower(link, "image")
    image = np.random.default_rng(0).integers(0, 255, (224, 224, 3), np.uint8)

    async def request(deadline_s: float) -> None:
        ticket = await tower.reserve(1, time.perf_counter() + deadline_s)
        try:
            await tower.run(ticket, [image], normalize=True, request_id="bench")
        finally:
            ticket.release_all()

    return link, request


async def _drive(
    model: Path, card: Any, socket_path: str, engine_pid: int, seconds: float, connections: int
) -> dict[str, Any]:
    import psutil  # type: ignore[import-untyped]

    link, request = await _link(model, card, socket_path, 60)
    engine = psutil.Process(engine_pid)
    done = 0
    until = 0.0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < until:
            await request(10.0)
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


def _model(tmp: str) -> Path:
    from clipserve.loadgen.procs import TINY_CONFIG

    model = Path(tmp) / "fake-512.json"
    model.write_text(json.dumps({**TINY_CONFIG, "embed_dim": 512}))
    return model


def one(seconds: float, connections: int) -> dict[str, Any]:
    """One measurement of the tree this process imports clipserve from."""
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        model = _model(tmp)
        socket_path = str(Path(tmp) / "engine.sock")
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        engine = ctx.Process(target=_engine_piped, args=(model, socket_path, theirs), daemon=True)
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


async def _send(
    model: Path, card: Any, socket_path: str, engine_pid: int, per_client: int, connections: int
) -> None:
    """A warm-up, then `per_client` requests from each of `connections` clients with the
    engine's instrumentation on (nothing in flight as it turns on or off)."""
    # Under callgrind everything is ~50 times slower (hence the long deadlines), and the
    # engine pushes no status: the link must not count it as silent while instrumentation
    # turns on.
    quiet = ("--heartbeat-timeout-s", "3600")
    link, request = await _link(model, card, socket_path, 600, *quiet)

    async def clients(n: int) -> None:
        async def client() -> None:
            for _ in range(n):
                await request(600.0)

        await asyncio.gather(*(client() for _ in range(connections)))

    await clients(8)
    for state in ("on", "off"):
        if state == "off":
            await clients(per_client)
        command = ["callgrind_control", "-i", state, str(engine_pid)]
        await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True)
    await link.close()


def count(per_client: int, connections: int, keep: Path | None = None) -> int:
    """The engine's instructions while each of `connections` clients sent `per_client`
    requests (every thread; start-up and warm-up not counted), for the tree this process
    imports clipserve from. `keep`: a folder for callgrind's file, for callgrind_annotate."""
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        model = _model(tmp)
        socket_path, card_path = str(Path(tmp) / "engine.sock"), Path(tmp) / "card.json"
        tool = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        kept = keep / f"callgrind.{per_client * connections}.out" if keep else "/dev/null"
        tool += [f"--callgrind-out-file={kept}"]
        argv = [*tool, sys.executable, __file__, "--engine", str(model), socket_path]
        log = Path(tmp) / "engine.log"
        with log.open("w") as err:  # a file, not a pipe nobody reads while it serves
            engine = subprocess.Popen([*argv, str(card_path)], stdout=err, stderr=err)
        try:
            deadline = time.monotonic() + 900
            while not card_path.exists():
                if engine.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not start: {log.read_text()[-2000:]}")
                time.sleep(0.5)
            os.sched_setaffinity(0, {DRIVER_CPU})
            card = json.loads(card_path.read_text())
            uvloop.run(_send(model, card, socket_path, engine.pid, per_client, connections))
        finally:
            engine.terminate()
            try:
                engine.wait(300)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()
        found = re.search(r"Collected : (\d+)", log.read_text())
        if found is None:
            raise RuntimeError(f"callgrind counted nothing: {log.read_text()[-2000:]}")
        return int(found[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="name=path (repeatable)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--out", type=Path)
    p.add_argument("--callgrind", action="store_true", help="instructions, not CPU time")
    p.add_argument("--requests", type=int, default=128, help="--callgrind: N (and 4N)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keep", type=Path, help="--callgrind: a folder for its files, a tree each")
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)  # requests a client
    p.add_argument("--engine", nargs=3, help=argparse.SUPPRESS)  # model socket card
    a = p.parse_args()
    if a.engine:
        _engine_to_file(Path(a.engine[0]), a.engine[1], Path(a.engine[2]))
        return
    if a.count is not None:
        print(count(a.count, a.connections, a.keep))
        return
    if a.one:
        print(json.dumps(one(a.seconds, a.connections)))
        return
    trees = {"this": REPO} | {n: Path(t) for n, t in (x.split("=", 1) for x in a.tree)}
    if a.callgrind:
        _callgrind(trees, a.requests, a.connections, a.keep, a.out)
        return
    from bench.common import machine, rotated, say, spread, utc_now, write_report

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


def _counted(tree: Path, connections: int, keep: Path | None, requests: int) -> int:
    """`count` for `tree`'s clipserve, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}"}
    argv = [sys.executable, __file__, "--count", str(requests // connections)]
    argv += ["--connections", str(connections), *(["--keep", str(keep)] if keep else [])]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def _callgrind(
    trees: dict[str, Path], requests: int, connections: int, keep: Path | None, out: Path | None
) -> None:
    from bench.common import machine, per_request, say, utc_now, write_report

    per_client = max(1, requests // connections)
    counts: dict[str, float] = {}
    for name, tree in trees.items():
        kept = keep / name if keep else None
        if kept:
            kept.mkdir(parents=True, exist_ok=True)
        run = functools.partial(_counted, tree, connections, kept)
        counts[name] = round(per_request(run, per_client * connections, float), 1)
        say(f"{name}: {counts[name]:,.0f} instructions a request")
    write_report(
        {
            "benchmark": "engine_link_callgrind",
            "when": utc_now(),
            "machine": machine(),
            "payload": "one 224x224x3 uint8 image (150 KB) per request, through a slot",
            "backend": "fake, compute=0, cache off",
            "connections": connections,
            "requests": [per_client * connections, 4 * per_client * connections],
            "trees": {n: str(t) for n, t in trees.items()},
            "instructions_per_request": counts,
            "over_this": {n: round(c / counts["this"], 4) for n, c in counts.items()},
        },
        out,
    )


if __name__ == "__main__":
    main()
