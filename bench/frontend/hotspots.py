"""Where the microseconds of one request go: a server at saturation under py-spy, its event loop
thread's functions as µs per request (inclusive and self), beside its CPU per request.

    python -m bench.frontend.hotspots --server w1 --tree /tmp/clipserve-before > before.txt
    python -m bench.frontend.hotspots --server floor
    python -m bench.frontend.hotspots --server direct   # /embed under a bare protocol

One core for the server (the first), wrk or the aiohttp client on the last; fake backend with
compute=0, --cache-mb 0, one 150 KB uint8 tensor per request (bench/frontend/load.py). The
shares are of the event loop thread's samples; µs = share x the server's CPU per request
measured under py-spy (which slows it a little), so they add up to about that.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.frontend import servers
from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.load import requests_of, saturate
from bench.frontend.servers import Server, affinity, clipserve, fake_flags, split_cpus, start

STARTUP = ("_find_and_load", "build_runtime", "warmup", "load_model")


def loop_counters(raw: Path, thread: str = "MainThread") -> tuple[Counter[str], Counter[str], int]:
    """py-spy's raw stacks of one thread: samples per function on the stack (inclusive), per
    leaf function (self), and in all. Start-up stacks are left out."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or any(s in stack for s in STARTUP):
            continue
        frames = stack.split(";")
        heads = [i for i, f in enumerate(frames) if f.startswith("thread (")]
        if not heads or thread not in frames[heads[0]]:
            continue
        names = [re.sub(r":\d+\)$", ")", f) for f in frames[heads[0] + 1 :]]
        if not names:
            continue
        n = int(count)
        total += n
        own[names[-1]] += n
        for name in set(names):
            inclusive[name] += n
    return inclusive, own, total


def report(name: str, row: dict[str, object], raw: Path, top: int) -> str:
    inclusive, own, total = loop_counters(raw)
    cpu_us = float(str(row["server_cpu_ms_per_request"])) * 1000
    lines = [
        f"== {name}: {row['requests_per_s']} requests/s under py-spy, "
        f"{cpu_us:.0f} µs of server CPU per request; event loop thread: {total} samples",
        "-- inclusive (µs per request, share of the loop thread's samples)",
    ]
    lines += [
        f"{v / total * cpu_us:8.1f} µs {v / total:6.1%}  {k}" for k, v in inclusive.most_common(top)
    ]
    lines.append("-- self")
    lines += [
        f"{v / total * cpu_us:8.1f} µs {v / total:6.1%}  {k}" for k, v in own.most_common(top)
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.frontend.hotspots", description=__doc__)
    p.add_argument(
        "--server",
        default="w1",
        help="w1 or w2 (front ends), floor, floor-kept, bare or direct (bench/frontend/servers.py)",
    )
    p.add_argument("--tree", type=Path, help="a checkout to serve from (default: this one)")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--top", type=int, default=45)
    a = p.parse_args()
    server_cpus, client_cpus = split_cpus(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "fake-512.json"
        model.write_text(json.dumps(FAKE_CONFIG))
        others = {"floor": servers.floor, "floor-kept": servers.floor_kept, "bare": servers.bare}
        s: Server
        if a.server in others:
            s = others[a.server]()
        elif a.server == "direct":
            s = servers.direct(model)
        else:
            s = clipserve(a.server, [*fake_flags(model), "--workers", a.server[1:]], a.tree)
        raw = Path(tmp) / "profile.raw"
        reqs = requests_of("raw-tensor")
        with start(s, server_cpus, profile=raw) as r, affinity(client_cpus):
            saturate(r, reqs, 2.0, a.connections, 1)  # warm-up
            row = saturate(r, reqs, a.seconds, a.connections, 1)
        deadline = time.monotonic() + 60
        while not raw.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        print(report(f"{a.server} ({a.tree or 'this checkout'})", row, raw, a.top))


if __name__ == "__main__":
    main()
