"""The process hop on one core (issue 23): clipserve `--workers 2` (two front ends and the engine,
all pinned to one core) against `--workers 1`, tensor requests at saturation, wrk on the other
core. Optionally the same two servers from a second checkout (`--before-tree`), all four in
interleaved rounds, so that each round's w2/w1 ratio and after/before ratio pair points measured
seconds apart on a machine other benchmarks share.

Beside requests/s and CPU per request (per role), each point counts context switches per request
per role: on one core every control frame that wakes another process costs a switch.

    python -m bench.workers_hop --before-tree /tmp/hopbase --rounds 7 --seconds 4 \
        --out bench/results/workers-hop.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

from bench.common import machine, rotated, say, utc_now, write_report
from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.load import clean, client, requests_of, saturate, spread
from bench.frontend.servers import (
    Running,
    Server,
    clipserve,
    fake_flags,
    pinning,
    role,
    split_cpus,
    start_all,
)
from bench.frontend.servers import affinity as pinned
from clipserve.loadgen.payloads import Request


def switches(r: Running) -> dict[int, tuple[int, str]]:
    """Context switches (voluntary + involuntary, all threads) of each process of the tree."""
    out = {}
    for p in [r.root, *r.root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            c = p.num_ctx_switches()
            out[p.pid] = (c.voluntary + c.involuntary, role(p, r.root))
    return out


def point(r: Running, a: argparse.Namespace, reqs: Any, threads: int) -> dict[str, Any]:
    before = switches(r)
    row = saturate(r, reqs, a.seconds, a.connections, threads)
    after = switches(r)
    by_role: dict[str, int] = defaultdict(int)
    for pid, (n, label) in after.items():
        by_role[label] += n - before.get(pid, (0, label))[0]
    ok = max(row["requests"] - row["failed"], 1)
    row["switches_per_request_by_role"] = {k: round(v / ok, 3) for k, v in by_role.items()}
    row["load_average_1m"] = round(os.getloadavg()[0], 2)
    return row


def ratios(rows: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Per round: numerator's requests/s over the denominator's; medians with spread."""
    rate = {(x["server"], x["round"]): x["requests_per_s"] for x in rows if clean(x)}
    rounds = sorted({x["round"] for x in rows})
    return {
        f"{num} / {den} requests/s": spread(
            [rate[num, r] / rate[den, r] for r in rounds if (num, r) in rate and (den, r) in rate]
        )
        for num, den in pairs
    }


def summary(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    mine = [x for x in rows if x["server"] == name and clean(x)]
    roles = sorted({k for x in mine for k in x["cpu_ms_per_request_by_role"]})
    return {
        "requests_per_s": spread([x["requests_per_s"] for x in mine]),
        "cpu_ms_per_request": spread([x["server_cpu_ms_per_request"] for x in mine]),
        "cpu_ms_per_request_by_role": {
            k: spread([x["cpu_ms_per_request_by_role"].get(k, 0.0) for x in mine]) for k in roles
        },
        "switches_per_request_by_role": {
            k: spread([x["switches_per_request_by_role"].get(k, 0.0) for x in mine]) for k in roles
        },
    }


def one_core_rounds(
    servers: list[Server],
    rounds: int,
    connections: int,
    measure: Callable[[Running, list[Request], int], dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, list[int]]]:
    """The servers on one core and wrk on another, warmed up, then `rounds` rounds of tensor
    requests in rotated order: each point's row (`measure`'s, with its round; `line` says it),
    the servers that did not start, and the pinning."""
    server_cpus, client_cpus = split_cpus(1)
    reqs = requests_of("raw-tensor")
    threads = len(client_cpus or {0})
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack, pinned(client_cpus):
        up, skipped = start_all(stack, servers, server_cpus)
        for r in up:  # warm-up: connections, caches, the batcher's first batches
            saturate(r, reqs, 1.0, connections, threads)
        for rnd in range(rounds):
            for r in rotated(up, rnd):
                row = {"round": rnd, **measure(r, reqs, threads)}
                rows.append(row)
                say(f"round {rnd} {r.server.name}: {line(row)}")
    return rows, skipped, pinning(server_cpus, client_cpus)


def report_head(
    benchmark: str, pins: dict[str, list[int]], a: argparse.Namespace
) -> dict[str, Any]:
    """What every one-core report starts with: when, where, and the load."""
    return {
        "benchmark": benchmark,
        "when": utc_now(),
        "machine": machine(),
        "pinning": pins,
        "client": client(),
        "payload": "raw-tensor, one 224x224x3 uint8 crop (150 KB) per request",
        "backend": "fake, compute=0, cache off",
        "connections": a.connections,
        "seconds_per_point": a.seconds,
        "rounds": a.rounds,
    }


def run(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    trees: dict[str, Path | None] = {"after": a.tree}
    if a.before_tree:
        trees["before"] = a.before_tree
    servers = [
        clipserve(f"{t}-w{n}", [*fake_flags(model), "--workers", str(n)], tree)
        for t, tree in trees.items()
        for n in (1, 2)
    ]
    rows, skipped, pins = one_core_rounds(
        servers,
        a.rounds,
        a.connections,
        lambda r, reqs, threads: point(r, a, reqs, threads),
        lambda row: (
            f"{row['requests_per_s']} req/s, {row['server_cpu_ms_per_request']} CPU ms/req, "
            f"switches/req {row['switches_per_request_by_role']}"
        ),
    )
    names = [s.name for s in servers if s.name not in skipped]
    pairs = [(f"{t}-w2", f"{t}-w1") for t in trees]
    if a.before_tree:
        pairs += [("after-w1", "before-w1"), ("after-w2", "before-w2")]
    return {
        **report_head("workers_hop", pins, a),
        "trees": {k: str(v) if v else "this checkout" for k, v in trees.items()},
        "skipped": skipped,
        "ratios": ratios(rows, [p for p in pairs if set(p) <= set(names)]),
        "summary_medians": {n: summary(rows, n) for n in names},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.workers_hop", description=__doc__)
    p.add_argument("--before-tree", type=Path, help="a second checkout, measured beside this")
    p.add_argument("--tree", type=Path, help="the checkout measured (default: this one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--note", default="", help="recorded as is: the load, what changed")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "fake-512.json"
        model.write_text(json.dumps(FAKE_CONFIG))
        report = run(a, model)
    report["note"] = a.note
    write_report(report, a.out)


if __name__ == "__main__":
    main()
