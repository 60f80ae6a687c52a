"""The HTTP protocol layer alone (uvicorn's httptools protocol as clipserve configures it, with
its request-response cycle): CPU per request and system calls per request, checkouts side by
side.

One process per measurement serves a trivial ASGI app (reads the body, answers 6 KB with a
content-length) on one end of a loopback TCP connection under uvloop; a thread of the same
process sends 150 KB requests (--body-bytes) one after another on the other end. The loop
thread's CPU per request is the protocol's, the app's few lines, and the kernel's share of the
socket calls. The checkouts take turns, one process each per round (this machine's speed drifts
by tens of percent within a minute: the per-round ratio is what is compared). Where strace is
installed, one more run per checkout counts the server's writes and the client's reads per
request; where valgrind is, callgrind counts the event loop thread's instructions per request.
Neither drifts.

    python -m bench.http_cycle --tree before=/tmp/cs-before --tree after=. --rounds 16 \
        --out bench/results/http-cycle.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BODY_ENV = "HTTP_CYCLE_BODY_BYTES"  # --body-bytes, to the measuring processes
BODY_BYTES = int(os.environ.get(BODY_ENV, 150_528))  # default: one 224x224x3 uint8 tensor
ANSWER = b"e" * 6000  # about a 512-float JSON embedding
HEADERS = [
    (b"content-length", b"%d" % len(ANSWER)),
    (b"content-type", b"application/json"),
    (b"server-timing", b"receive;dur=0.01, queue;dur=0.2, compute;dur=0.1"),
]
# The server's writes (libuv: write, writev) and the client's reads (Python: recvfrom).
COUNTED = ("write", "writev", "recvfrom", "read")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def _client(sock: socket.socket, requests: int, done: Any) -> None:
    request = b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % BODY_BYTES
    request += os.urandom(BODY_BYTES)
    for _ in range(requests):
        sock.sendall(request)
        got = b""
        while not got.endswith(ANSWER):
            got += sock.recv(1 << 16)
    done()


async def _serve(requests: int) -> float:
    """The loop thread's CPU µs per request, after a warm-up."""
    import uvicorn

    from clipserve.config import HttpConfig
    from clipserve.http.connections import connection_factory
    from clipserve.http.server import build_uvicorn_config

    config = build_uvicorn_config(app, HttpConfig(), port=0, log_level="warning")
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # TCP, as served: loopback
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(connection_factory(server), ours)
    spent = 0.0
    for n in (requests // 5, requests):  # warm-up, then measured
        finished = loop.create_future()
        done = lambda f=finished: loop.call_soon_threadsafe(f.set_result, None)  # noqa: E731
        start = time.thread_time()
        thread = threading.Thread(target=_client, args=(theirs, n, done))
        thread.start()
        await finished
        spent = time.thread_time() - start
        thread.join()
    return spent / requests * 1e6


def _run(tree: str, requests: int, tool: list[str] | None = None) -> float:
    # This file run by path with only `tree` on the path: its clipserve is the one measured.
    code = f"import runpy, sys; sys.argv[1:] = ['--serve', '{requests}']; "
    code += f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    cmd = [*(tool or []), sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tree)
    return float(out.stdout.split()[-1])


def _calls(path: Path, requests: int) -> dict[str, float]:
    """System calls per request of `COUNTED`, from `strace -c`'s table (warm-up included)."""
    counts: dict[str, float] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[-1] in COUNTED and re.fullmatch(r"\d+", fields[3]):
            counts[fields[-1]] = round(int(fields[3]) / (requests * 1.2), 2)
    return counts


def _instructions(tree: str, requests: int, tmp: Path) -> float:
    """The event loop thread's instructions per request under callgrind (warm-ups included)."""
    from bench.common import per_request

    def count(n: int) -> int:
        out = tmp / f"cg.{n}"
        tool = ["valgrind", "--tool=callgrind", "--separate-threads=yes"]
        _run(tree, n, [*tool, f"--callgrind-out-file={out}"])
        summary = re.search(r"^summary: (\d+)", Path(f"{out}-01").read_text(), re.M)
        assert summary is not None, f"no summary in {out}-01"
        return int(summary[1])

    return per_request(count, requests, lambda n: n * 1.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="name=path of a checkout")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # one measuring process
    parser.add_argument("--out", type=Path)
    parser.add_argument("--body-bytes", type=int, help="request body size (default 150,528)")
    a = parser.parse_args()
    if a.body_bytes is not None:
        global BODY_BYTES
        BODY_BYTES = a.body_bytes
        os.environ[BODY_ENV] = str(a.body_bytes)
    if a.serve:
        import uvloop

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        print(uvloop.run(_serve(a.serve)))
        return
    from bench.common import machine, rotated, spread, utc_now, write_report

    trees = dict(t.split("=", 1) for t in a.tree) or {"this": "."}
    names = list(trees)
    runs: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(a.rounds):
        for name in rotated(names, rnd):
            runs[name].append(_run(str(Path(trees[name]).resolve()), a.requests))
        print(f"round {rnd}: " + ", ".join(f"{n} {runs[n][-1]:.1f} µs" for n in names))
    report: dict[str, Any] = {
        "benchmark": "http_cycle",
        "date": utc_now(),
        "machine": machine(),
        "note": __doc__.split("\n\n")[1].replace("\n", " "),
        "requests_per_process": a.requests,
        "body_bytes": BODY_BYTES,
        "loop_cpu_us_per_request": {n: spread(runs[n], 1) for n in names},
    }
    first = names[0]
    report["ratio_to_" + first] = {
        n: spread([x / y for x, y in zip(runs[n], runs[first], strict=True)], 3) for n in names[1:]
    }
    with tempfile.TemporaryDirectory() as tmp:
        if shutil.which("strace"):
            calls = {}
            for name in names:
                path = Path(tmp) / f"{name}.txt"
                _run(
                    str(Path(trees[name]).resolve()),
                    a.requests,
                    ["strace", "-f", "-c", "-o", str(path)],
                )
                calls[name] = _calls(path, a.requests)
            report["syscalls_per_request"] = calls
        if shutil.which("valgrind"):  # deterministic, where the CPU time above is not
            report["callgrind_loop_thread_instructions_per_request"] = {
                name: round(_instructions(str(Path(trees[name]).resolve()), 100, Path(tmp)))
                for name in names
            }
    write_report(report, a.out)


if __name__ == "__main__":
    main()
