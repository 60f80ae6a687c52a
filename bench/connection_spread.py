"""How `--workers 2` spreads a burst of keep-alive connections over its front ends: one shared
accept queue (the default) against a socket per front end (`--reuse-port`).

Each round starts both servers in turn (fake backend, compute=0, cache off; order rotated) and
opens `--connections` connections at once, `--bursts` times, with one request on each; then
counts the connections each front end accepted. A second measure per round runs the bundled load
generator (closed loop, as many clients as connections, one 150 KB uint8 tensor a request) and
counts each front end's connections while it runs. Reported: the smaller front end's share per
burst (0.5 is an even spread).

    python -m bench.connection_spread --rounds 5 --out bench/results/connection-spread.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.load import spread
from bench.frontend.servers import fake_flags, wait_front_ends
from clipserve.loadgen.procs import clipserve_process

REPO = Path(__file__).resolve().parent.parent
MODES = {"shared": [], "reuse-port": ["--reuse-port"]}


def _per_front_end(supervisor: int, port: int) -> list[int]:
    counts = []
    for child in psutil.Process(supervisor).children():
        conns = child.net_connections("tcp")
        if any(c.laddr.port == port and c.status == "LISTEN" for c in conns):
            counts.append(sum(1 for c in conns if c.raddr and c.laddr.port == port))
    return sorted(counts)


async def _burst(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(n)))
    for _, writer in conns:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n")
    await asyncio.gather(*(reader.readuntil(b"\r\n\r\n") for reader, _ in conns))
    return conns


def bursts(supervisor: int, port: int, n: int, count: int) -> list[list[int]]:
    out = []
    for _ in range(count):

        async def once() -> list[int]:
            conns = await _burst(port, n)
            try:
                return _per_front_end(supervisor, port)
            finally:
                for _, writer in conns:
                    writer.close()

        out.append(asyncio.run(once()))
        time.sleep(0.5)  # the closed connections gone from the front ends
    return out


def under_load(supervisor: int, port: int, n: int, seconds: float, report: Path) -> dict[str, Any]:
    bench = [sys.executable, "-m", "clipserve.loadgen", "--url", f"http://127.0.0.1:{port}"]
    bench += ["-p", "raw-tensor", "-c", str(n), "-d", str(seconds), "--warmup", "1"]
    load = subprocess.Popen([*bench, "--json", str(report)], stdout=subprocess.DEVNULL)
    time.sleep(1 + seconds / 2)
    counts = _per_front_end(supervisor, port)
    if load.wait(seconds + 60) != 0 or not report.exists():
        raise SystemExit(f"the load generator exited {load.returncode} without {report}")
    point = json.loads(report.read_text())["results"][0]
    return {"connections": counts, "requests_per_s": point["requests_per_s"]}


def measure(mode: str, model: Path, a: argparse.Namespace) -> dict[str, Any]:
    flags = ["--workers", "2", *fake_flags(model), *MODES[mode]]
    with clipserve_process(flags, startup_s=120, cwd=REPO) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        wait_front_ends(psutil.Process(proc.pid), 2, port)
        return {
            "bursts": bursts(proc.pid, port, a.connections, a.bursts),
            "under_load": under_load(
                proc.pid, port, a.connections, a.seconds, model.with_name(f"load-{mode}.json")
            ),
        }


def smaller_share(counts: list[int]) -> float:
    return min(counts) / sum(counts) if len(counts) == 2 and sum(counts) else 0.0


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        shares = [smaller_share(c) for r in rounds for c in r[mode]["bursts"]]
        loaded = [smaller_share(r[mode]["under_load"]["connections"]) for r in rounds]
        rates = [r[mode]["under_load"]["requests_per_s"] for r in rounds]
        out[mode] = {
            "burst_smaller_share": spread(shares),
            "under_load_smaller_share": spread(loaded),
            "under_load_requests_per_s": spread(rates),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bursts", type=int, default=5)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "fake-512.json"
        model.write_text(json.dumps(FAKE_CONFIG))
        for i in range(a.rounds):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            rounds.append({mode: measure(mode, model, a) for mode in order})
            print(json.dumps({"round": i, **summary(rounds[-1:])}), flush=True)
    result = {
        "benchmark": "connection_spread",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{psutil.cpu_count()} cores, unpinned (server and client share them)",
        "connections": a.connections,
        "rounds": rounds,
        "summary": summary(rounds),
    }
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
