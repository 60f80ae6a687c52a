"""The batching section: mean batch size at a fixed open-loop rate with a slow fake batch, N
front ends against one (target: within 10%)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from bench.common import rotated, say
from bench.frontend.load import requests_of, spread
from bench.frontend.servers import affinity, clipserve, fake_flags, split_cpus, start_all
from clipserve.loadgen.loadgen import LoadSpec
from clipserve.loadgen.runner import run_point


def section_batching(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    server_cpus, client_cpus = split_cpus(a.client_cores)
    reqs = requests_of("raw-tensor")
    flags = fake_flags(model, f"latency_ms={a.batch_latency_ms}")
    servers = [clipserve(f"w{n}", [*flags, "--workers", str(n)]) for n in (1, a.batching_workers)]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack, affinity(client_cpus):
        up, skipped = start_all(stack, servers, server_cpus)
        spec = LoadSpec(rate=a.batching_rate, duration_s=a.seconds * 2, warmup_s=1.0)
        for r in up:
            run_point(r.url, reqs, LoadSpec(rate=a.batching_rate, duration_s=1.0))
        for rnd in range(a.rounds):
            for r in rotated(up, rnd):
                p = run_point(r.url, reqs, spec)
                server = p.server or {}
                rows.append(
                    {
                        "round": rnd,
                        "server": r.server.name,
                        "mean_batch_size": server.get("mean_batch_size"),
                        "batched_share": server.get("batched_share"),
                        "images_per_s": p.images_per_s,
                        "latency_ms": p.latency_ms,
                        "statuses": p.statuses,
                        "warnings": p.warnings,
                    }
                )
                say(f"batching round {rnd} {r.server.name}: batch {server.get('mean_batch_size')}")
    by = {(x["round"], x["server"]): x["mean_batch_size"] for x in rows}
    many = f"w{a.batching_workers}"
    ratios = [
        by[(i, many)] / by[(i, "w1")]
        for i in range(a.rounds)
        if (i, many) in by and (i, "w1") in by
    ]
    med = spread(ratios)
    sizes = {s.name: [x["mean_batch_size"] for x in rows if x["server"] == s.name] for s in servers}
    return {
        "offered_requests_per_s": a.batching_rate,
        "fake_batch_latency_ms": a.batch_latency_ms,
        "payload": "one raw uint8 224x224x3 tensor per request, Poisson arrivals",
        "skipped": skipped,
        "mean_batch_size": {name: spread([x for x in v if x]) for name, v in sizes.items()},
        f"{many}_over_w1": med,
        "within_10_percent": None if med is None else abs(med["median"] - 1) <= 0.10,
        "rows": rows,
    }
