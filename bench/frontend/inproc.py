"""The app's own event-loop CPU per tensor request, without uvicorn or a socket: checkouts side
by side, in interleaved rounds.

The cost section (bench/frontend/cost.py) measures what a deployment pays, uvicorn's protocol
included, and on this shared 2-core machine its rounds spread by ±10%: a change of 5% to the
app's own code drowns in it. Here each checkout serves the same ASGI calls in a process of its
own (fake backend, compute=0, --cache-mb 0, one 150 KB uint8 tensor per POST /embed, N
requests in flight), and the process's CPU time per request is what is compared.

    python -m bench.frontend.inproc --tree before=/tmp/cs-before --tree after=. --rounds 7

With --resident each checkout's process starts once and serves one batch of requests per round
when asked, the checkouts taking turns a second apart: a round's pair then shares the machine's
load (other sessions' tests come and go within the ~15 s a fresh process takes to start), and
the per-round ratios, not only the medians, are reported.

    python -m bench.frontend.inproc --resident --tree before=/tmp/cs-before --tree after=. \
        --rounds 40 --requests 3000

With --callgrind, the same requests are counted in instructions, which do not drift with the
machine's speed as CPU time does (here by ±40% within seconds): each checkout's process runs
under callgrind with instrumentation off until its warm-up is done, twice (N and 4N requests),
and the difference over 3N is its instructions per request, every thread included.

    python -m bench.frontend.inproc --callgrind --tree before=/tmp/cs-before --tree after=. \
        --requests 640
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

CALLGRIND_ENV = "INPROC_CALLGRIND"  # set in a process that runs under callgrind

TENSOR_HEADERS = [
    (b"content-type", b"application/octet-stream"),
    (b"x-tensor-dtype", b"uint8"),
    (b"x-tensor-shape", b"1,224,224,3"),
    (b"content-length", b"150528"),
    (b"host", b"127.0.0.1:8000"),
]


async def _serve(model: Path, requests: int, concurrency: int, resident: bool = False) -> float:
    """CPU µs per request of `requests` tensor POSTs, `concurrency` in flight at a time.
    `resident`: one such batch per `go` line on stdin, its µs printed, until stdin closes."""
    from prometheus_client import CollectorRegistry

    from clipserve.config import load_config
    from clipserve.http.app import create_app

    flags: dict[str, str | list[str] | None] = {
        "model": str(model),
        "backend": "fake",
        "pretrained": "none",
        "gpus": "cpu",
        "backend_option": ["compute=0"],
        "cache_mb": "0",
        "grpc_port": "0",
    }
    app = create_app(load_config(flags, environ={}), registry=CollectorRegistry())
    body = bytes(range(256)) * (150_528 // 256) + bytes(150_528 % 256)

    import clipserve.http.request as request_module

    # The connection's disconnect signal, as GuardedHttpProtocol puts it in the scope; a
    # checkout from before it has none (its pipeline watches with a task per request).
    watch_key: str | None = getattr(request_module, "WATCH_SCOPE_KEY", None)

    async def one(state: dict[str, Any], connection: dict[str, Any]) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/embed",
            "raw_path": b"/embed",
            "root_path": "",
            "query_string": b"",
            "headers": list(TENSOR_HEADERS),
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
            "state": dict(state),
            **connection,
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        connected = asyncio.Event()  # set never: the client stays until its answer
        status: list[int] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await connected.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(scope, receive, send)
        if status != [200]:
            raise RuntimeError(f"answered {status}")

    async def client(state: dict[str, Any], n: int) -> None:
        # One kept-alive connection: one watch for all its requests, as uvicorn's protocol has.
        connection = {watch_key: request_module.DisconnectWatch()} if watch_key else {}
        for _ in range(n):
            await one(state, connection)

    async with app.router.lifespan_context(app) as lifespan_state:
        state = dict(lifespan_state or {})
        await asyncio.gather(*(client(state, 50) for _ in range(concurrency)))  # warm up
        per_client = requests // concurrency

        async def batch() -> float:
            _instrument("on")
            t0 = time.process_time()
            await asyncio.gather(*(client(state, per_client) for _ in range(concurrency)))
            spent = time.process_time() - t0
            _instrument("off")
            return spent / (per_client * concurrency) * 1e6

        if not resident:
            return await batch()
        loop = asyncio.get_running_loop()
        print("ready", flush=True)
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "go":
            print(await batch(), flush=True)
        return 0.0


def _instrument(state: str) -> None:
    """Callgrind's instrumentation of this process on or off, where it runs under callgrind
    for `_instructions` (callgrind_control reaches it while it waits for the command)."""
    if os.environ.get(CALLGRIND_ENV):
        command = ["callgrind_control", "-i", state, str(os.getpid())]
        subprocess.run(command, check=True, capture_output=True)


def _instructions(tree: Path, model: Path, requests: int, concurrency: int) -> float:
    """One checkout's instructions per request: two runs under callgrind, N and 4N requests."""
    from bench.common import per_request

    def count(n: int) -> int:
        argv, env = _serving(tree, model, n, concurrency, resident=False)
        tool = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--callgrind-out-file=/dev/null",
        ]
        out = subprocess.run(
            [*tool, *argv],
            env={**env, CALLGRIND_ENV: "1"},
            capture_output=True,
            text=True,
            cwd=tree,
        )
        found = re.search(r"Collected : (\d+)", out.stderr)
        if out.returncode != 0 or found is None:
            raise RuntimeError(f"callgrind run failed ({out.returncode}): {out.stderr[-2000:]}")
        return int(found[1])

    # Only the measured batch is instrumented: n // concurrency requests per client.
    return per_request(count, requests, lambda n: n // concurrency * concurrency)


def _one_run(tree: Path, model: Path, requests: int, concurrency: int) -> float:
    """One checkout's µs per request, measured in a process of its own."""
    argv, env = _serving(tree, model, requests, concurrency, resident=False)
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True, cwd=tree)
    return float(out.stdout.strip().splitlines()[-1])


def _serving(
    tree: Path, model: Path, requests: int, concurrency: int, *, resident: bool
) -> tuple[list[str], dict[str, str]]:
    """The command (and its environment) that runs this file's `_serve` with only `tree`
    importable: the checkout need not have this file. Once, printing its µs per request; or
    resident, serving a batch per line read (`_Resident`)."""
    serve = (
        "ns['_serve'](Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), resident=True)"
        if resident
        else "ns['_serve'](Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
    )
    code = (
        "import asyncio, sys; from pathlib import Path; ns = {'__name__': 'inproc'}; "
        "exec(compile(open(sys.argv[4]).read(), sys.argv[4], 'exec'), ns); "
        + (f"asyncio.run({serve})" if resident else f"print(asyncio.run({serve}))")
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    here = str(Path(__file__).resolve())
    return [sys.executable, "-c", code, str(model), str(requests), str(concurrency), here], env


class _Resident:
    """One checkout's serving process, started once; `batch()` is one round's µs per request."""

    def __init__(self, tree: Path, model: Path, requests: int, concurrency: int) -> None:
        argv, env = _serving(tree, model, requests, concurrency, resident=True)
        self.proc = subprocess.Popen(
            argv, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the serving process exited ({self.proc.wait()})")
        return line.strip()

    def ready(self) -> None:
        while self._line() != "ready":
            pass

    def batch(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _resident_runs(
    trees: dict[str, Path], model: Path, rounds: int, requests: int, concurrency: int
) -> dict[str, list[float]]:
    from bench.common import rotated

    procs = {name: _Resident(tree, model, requests, concurrency) for name, tree in trees.items()}
    runs: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for proc in procs.values():
            proc.ready()
        for r in range(rounds):
            for name in rotated(list(trees), r):
                runs[name].append(procs[name].batch())
                print(f"round {r} {name}: {runs[name][-1]:.1f} µs CPU per request", file=sys.stderr)
    finally:
        for proc in procs.values():
            proc.close()
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="name=checkout, repeatable")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--resident", action="store_true", help="one process per checkout, rounds")
    p.add_argument("--callgrind", action="store_true", help="instructions per request instead")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in a.tree)}
    from bench.common import machine, spread
    from bench.frontend.cli import FAKE_CONFIG

    runs: dict[str, list[float]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "fake-512.json"
        model.write_text(json.dumps(FAKE_CONFIG))
        names = list(trees)
        if a.callgrind:
            counts = {
                n: _instructions(t, model, a.requests, a.concurrency) for n, t in trees.items()
            }
            report = {
                "benchmark": "the app's instructions per tensor request, in process, callgrind",
                "machine": machine(),
                "requests": [a.requests, 4 * a.requests],
                "concurrency": a.concurrency,
                "instructions_per_request": {n: round(c) for n, c in counts.items()},
                f"ratio_to_{names[0]}": {
                    n: round(c / counts[names[0]], 4) for n, c in counts.items()
                },
            }
            _write(report, a.out)
            return
        if a.resident:
            runs = _resident_runs(trees, model, a.rounds, a.requests, a.concurrency)
        for r in range(0 if a.resident else a.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated order
                us = _one_run(trees[name], model, a.requests, a.concurrency)
                runs[name].append(us)
                print(f"round {r} {name}: {us:.1f} µs CPU per request", file=sys.stderr)
    first = names[0]
    report = {
        "benchmark": "the app's own CPU per tensor request, in process (bench/frontend/inproc.py)",
        "machine": machine(),
        "load_average": os.getloadavg(),
        "requests": a.requests,
        "concurrency": a.concurrency,
        "rounds": a.rounds,
        "resident": a.resident,
        "cpu_us_per_request": {name: spread(v, 1) for name, v in runs.items()},
        f"ratio_to_{first}": {
            name: round(statistics.median(v) / statistics.median(runs[first]), 3)
            for name, v in runs.items()
        },
        f"per_round_ratio_to_{first}": {  # each round's pair shares that moment's load
            name: spread([x / y for x, y in zip(v, runs[first], strict=True)], 3)
            for name, v in runs.items()
            if name != first
        },
        "runs": runs,
    }
    _write(report, a.out)


def _write(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=1)
    if out:
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
