"""Results out: a text table, JSON, CSV, and PNG plots."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clipserve.loadgen.runner import PointResult

COLUMNS = (
    "load",
    "req/s",
    "img/s",
    "p50",
    "p90",
    "p99",
    "p99.9",
    "max",
    "errors",
    "unfinished",
    "batch",
    "batched",
    "queue",
    "compute",
    "$/M img",
)


def _stage(r: PointResult, stage: str) -> float | None:
    if r.server and r.server.get("stage_ms", {}).get(stage) is not None:
        return float(r.server["stage_ms"][stage])
    return r.server_timing_ms.get(stage)


def row(r: PointResult) -> dict[str, Any]:
    """One flat row per load point (the table and the CSV); milliseconds for times."""
    lat = r.latency_ms
    server = r.server or {}
    share = server.get("batched_share")
    return {
        "load": r.load,
        "req/s": r.requests_per_s,
        "img/s": r.images_per_s,
        "p50": lat.get("p50"),
        "p90": lat.get("p90"),
        "p99": lat.get("p99"),
        "p99.9": lat.get("p99.9"),
        "max": lat.get("max"),
        "errors": r.completed - r.ok,
        "unfinished": r.unfinished,
        "batch": server.get("mean_batch_size"),
        "batched": None if share is None else f"{share:.0%}",
        "queue": _stage(r, "queue"),
        "compute": _stage(r, "compute"),
        "$/M img": r.usd_per_million_images,
    }


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def table(results: Sequence[PointResult], markdown: bool = False) -> str:
    """Latencies in ms, of OK answers; `batch` is the server's mean batch size, `batched` the
    share of images that shared a forward pass, `queue`/`compute` the server's mean ms per
    request answered 200 (0 for a request that skipped the stage: a cache hit)."""
    rows = [[_cell(v) for v in row(r).values()] for r in results]
    cols = [c for i, c in enumerate(COLUMNS) if any(rw[i] != "-" for rw in rows)] or list(COLUMNS)
    keep = [COLUMNS.index(c) for c in cols]
    rows = [[rw[i] for i in keep] for rw in rows]
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return "\n".join(lines + ["| " + " | ".join(rw) + " |" for rw in rows])
    widths = [max(len(c), *(len(rw[i]) for rw in rows)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    out += ["  ".join(v.rjust(w) for v, w in zip(rw, widths, strict=True)) for rw in rows]
    return "\n".join(out)


def details(r: PointResult) -> str:
    """Per point: errors with a sample and their latencies, stage breakdown, warnings."""
    lines = []
    for status, sample in r.error_samples.items():
        lines.append(f"  {r.load}: {r.statuses.get(status, 0)} x {status}: {sample[:160]!r}")
    if r.error_latency_ms:
        e = r.error_latency_ms
        lines.append(
            f"  {r.load}: error answers took p50 {e['p50']:.2f} ms, p99 {e['p99']:.2f} ms "
            "(not in the percentiles above)"
        )
    server = r.server or {}
    stages = server.get("stage_ms") or r.server_timing_ms
    if stages:
        where = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        lines.append(f"  {r.load}: server ms per request answered 200: {where}")
    reached, counts = server.get("stage_ms_reached") or {}, server.get("stage_requests") or {}
    if reached and len(set(counts.values())) > 1:  # some requests skipped a stage
        most = max(counts.values())
        where = ", ".join(f"{k} {v:.2f} ({counts[k]:g} of {most:g})" for k, v in reached.items())
        lines.append(f"  {r.load}: server ms per request that reached the stage: {where}")
    lines += [f"  {r.load}: warning: {w}" for w in r.warnings]
    return "\n".join(lines)


def write_json(path: Path, meta: dict[str, Any], results: Sequence[PointResult]) -> None:
    doc = {**meta, "results": [r.to_dict() for r in results]}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def csv_text(results: Sequence[PointResult]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["mode", *COLUMNS])
    writer.writeheader()
    for r in results:
        writer.writerow({"mode": r.mode, **row(r)})
    return buf.getvalue()


def plot(path: Path, results: Sequence[PointResult], title: str = "") -> bool:
    """Latency percentiles against throughput, and batch size against load. False without
    matplotlib (pip install 'clipserve[bench]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [r.images_per_s for r in results]
    for p in ("p50", "p90", "p99", "p99.9"):
        ax1.plot(x, [r.latency_ms.get(p, 0.0) for r in results], marker="o", label=p)
    for r in results:
        ax1.annotate(
            r.load,
            (r.images_per_s, r.latency_ms.get("p99", 0.0)),
            fontsize=7,
            textcoords="offset points",
            xytext=(3, 3),
        )
    ax1.set(
        xlabel="throughput (images/s)",
        ylabel="latency (ms)",
        yscale="log",
        title="latency vs throughput",
    )
    ax1.legend()
    load = [float(r.concurrency if r.concurrency is not None else r.rate or 0) for r in results]
    batch = [(r.server or {}).get("mean_batch_size") or 0.0 for r in results]
    ax2.plot(load, batch, marker="o")
    ax2.set(
        xlabel="offered load (" + ("concurrency" if results[0].concurrency else "req/s") + ")",
        ylabel="mean batch size (server)",
        title="batch size vs load",
    )
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
