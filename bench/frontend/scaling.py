"""The scaling section: saturated requests/s of tensor requests with each of --workers-list
front ends, and each count's share of linear scaling from one. With --scaling-reuse-port, each
count above one also with `--reuse-port` (named `wNr`): a socket per front end, so the client's
connections spread over them rather than gathering on whichever accepts first. Its numbers are
keyed by server name (w1, w2, w2r: runs before --scaling-reuse-port used the count alone)."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from pathlib import Path
from typing import Any

from bench.common import rotated, say
from bench.frontend.load import clean, requests_of, saturate, spread
from bench.frontend.servers import (
    affinity,
    clipserve,
    fake_flags,
    pinning,
    split_cpus,
    start_all,
)


def section_scaling(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    # Few cores: no pinning (front ends, engine and client share them all); else the client
    # keeps its --client-cores and the server gets the rest.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    server_cpus, client_cpus = split_cpus(a.client_cores) if cores >= 4 else (None, None)
    reqs = requests_of("raw-tensor")
    servers = [
        clipserve(f"w{n}", [*fake_flags(model), "--workers", str(n)]) for n in a.workers_list
    ]
    if a.scaling_reuse_port:
        flags = [*fake_flags(model), "--reuse-port", "--workers"]
        servers += [clipserve(f"w{n}r", [*flags, str(n)]) for n in a.workers_list if n > 1]
    threads = len(client_cpus) if client_cpus else 1
    rows = []
    with contextlib.ExitStack() as stack, affinity(client_cpus):
        up, skipped = start_all(stack, servers, server_cpus)
        for r in up:
            saturate(r, reqs, 1.0, a.connections, threads)
        for rnd in range(a.rounds):
            for r in rotated(up, rnd):
                name, n = r.server.name, r.server.front_ends
                conns = max(a.connections, 16 * n)
                row = {"round": rnd, "workers": n, **saturate(r, reqs, a.seconds, conns, threads)}
                rows.append(row)
                say(f"scaling round {rnd} {name}: {row['requests_per_s']} req/s")
    rps = {
        s.name: [x["requests_per_s"] for x in rows if x["server"] == s.name and clean(x)]
        for s in servers
    }
    base = statistics.median(rps["w1"]) if rps.get("w1") else None
    return {
        "pinning": pinning(server_cpus, client_cpus),
        "payload": "one raw uint8 224x224x3 tensor per request, closed loop",
        "skipped": skipped,
        "requests_per_s": {n: spread(v) for n, v in rps.items() if v},
        "of_linear": {
            s.name: round(statistics.median(rps[s.name]) / (s.front_ends * base), 3)
            for s in servers
            if rps[s.name] and base
        },
        "rows": rows,
    }
