"""The policy and regression sections, one set of interleaved rounds: the tiny real model on
CPU under JPEG load at concurrency 32, the before tree against --max-queue-delay-ms in --delays;
batch-size histogram, img/s, p99 and the server tree's CPU per image."""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import rotated, say
from bench.frontend.load import metrics, requests_of, spread
from bench.frontend.servers import Running, Server, clipserve, start_all, tree_cpu
from bench.metrics import total
from clipserve.loadgen.loadgen import LoadSpec
from clipserve.loadgen.payloads import Request
from clipserve.loadgen.runner import run_point
from clipserve.loadgen.server import Samples

Rows = list[dict[str, Any]]


def servers_of(a: argparse.Namespace, model: Path) -> list[Server]:
    """The before tree, the default delay, and each of --delays."""
    from clipserve.config import BatchingConfig

    flags = ["--backend", "torch", "--pretrained", "none", "--model", str(model)]
    flags += ["--gpus", "cpu", "--max-batch-size", "32"]
    default = BatchingConfig().max_queue_delay_ms
    servers = []
    if a.before_tree:
        servers.append(clipserve("before", flags, a.before_tree))
    if default not in a.delays:
        servers.append(clipserve(f"after default ({default:g} ms)", [*flags, "--workers", "1"]))
    for d in a.delays:
        name = f"after {d:g} ms" + (" (default)" if d == default else "")
        delay = ["--workers", "1", "--max-queue-delay-ms", f"{d:g}"]
        servers.append(clipserve(name, [*flags, *delay]))
    return servers


def section_policy(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Batch policy and the no-regression check: one set of interleaved rounds."""
    servers = servers_of(a, model)
    reqs = requests_of("jpeg")
    rows: Rows = []
    with contextlib.ExitStack() as stack:
        up, skipped = start_all(stack, servers, None)
        for r in up:
            run_point(r.url, reqs, LoadSpec(concurrency=32, duration_s=2.0))
        spec = LoadSpec(concurrency=32, duration_s=a.policy_seconds, warmup_s=1.0)
        for rnd in range(a.rounds):
            for r in rotated(up, rnd):
                row = _point(r, reqs, spec)
                rows.append({"round": rnd, **row})
                say(
                    f"policy round {rnd} {r.server.name}: {row['images_per_s']} img/s, "
                    f"p99 {row['latency_ms'].get('p99')} ms"
                )
    summary = {s.name: _summary(mine) for s in servers if (mine := _of(rows, s.name))}
    default_name = next(
        (s.name for s in servers if s.name.startswith("after") and ("default" in s.name)), None
    )
    return {
        "model": "tiny open_clip (clipserve.loadgen.procs.TINY_CONFIG), random weights, torch CPU",
        "load": "closed loop, concurrency 32, 640x480 JPEG q90 (8 variants)",
        "before_tree": str(a.before_tree) if a.before_tree else None,
        "skipped": skipped,
        "summary_medians": summary,
        "regression": {
            "after_default_over_before_images_per_s": spread(
                _over_before(rows, default_name, "images_per_s", a.rounds)
            ),
            "after_default_over_before_server_cpu_per_image": spread(
                _over_before(rows, default_name, "server_cpu_ms_per_image", a.rounds)
            ),
            "after": default_name,
        },
        "rows": rows,
    }


def _point(r: Running, reqs: list[Request], spec: LoadSpec) -> dict[str, Any]:
    before, cpu0 = metrics(r), tree_cpu(r.root)
    p = run_point(r.url, reqs, spec)
    cpu1, after = tree_cpu(r.root), metrics(r)
    server = p.server or {}
    # Throughput here follows whatever else runs on the machine; server CPU per image computed
    # (warm-up included on both sides) much less so.
    cpu = sum(c - cpu0.get(pid, (0.0, ""))[0] for pid, (c, _) in cpu1.items())
    images = total(after, "clipserve_batch_size_sum") - total(before, "clipserve_batch_size_sum")
    return {
        "server": r.server.name,
        "images_per_s": p.images_per_s,
        "latency_ms": p.latency_ms,
        "server_cpu_ms_per_image": round(cpu / images * 1000, 3) if images else None,
        "mean_batch_size": server.get("mean_batch_size"),
        "batch_size_histogram": _histogram(before, after),
        "statuses": p.statuses,
        "warnings": p.warnings,
    }


def _of(rows: Rows, server: str) -> Rows:
    return [x for x in rows if x["server"] == server]


def _summary(mine: Rows) -> dict[str, Any]:
    hist: Counter[str] = Counter()
    for x in mine:
        hist.update(x["batch_size_histogram"])
    cpu = [x["server_cpu_ms_per_image"] for x in mine if x.get("server_cpu_ms_per_image")]
    return {
        "images_per_s": spread([x["images_per_s"] for x in mine]),
        "p50_ms": spread([x["latency_ms"]["p50"] for x in mine]),
        "p99_ms": spread([x["latency_ms"]["p99"] for x in mine]),
        "mean_batch_size": spread([x["mean_batch_size"] or 0 for x in mine]),
        "server_cpu_ms_per_image": spread(cpu),
        "batch_size_histogram_all_rounds": dict(hist),
    }


def _over_before(rows: Rows, name: str | None, key: str, rounds: int) -> list[float]:
    """`name`'s `key` over the before tree's, per round where both were measured."""
    by = {(x["round"], x["server"]): x.get(key) for x in rows}
    return [
        mine / before
        for i in range(rounds)
        if (mine := by.get((i, name))) is not None and (before := by.get((i, "before")))
    ]


def _histogram(before: Samples | None, after: Samples | None) -> dict[str, int]:
    """Batches per batch-size bucket (not cumulative) between two scrapes."""
    if before is None or after is None:
        return {}
    cum = sorted(
        (float(dict(labels)["le"]), v - before.get((name, labels), 0.0))
        for (name, labels), v in after.items()
        if name == "clipserve_batch_size_bucket"
    )
    out, prev = {}, 0.0
    for le, c in cum:
        if c - prev:
            out["+Inf" if le == float("inf") else f"<={le:g}"] = int(c - prev)
        prev = c
    return out
