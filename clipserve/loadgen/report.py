"""`clipserve-bench report`: the whole benchmark report, regenerated on whatever machine runs it.

Sections: executors offline; wire formats served (fake backend); queue delay x concurrency
(throughput and p99, with a plot); device scaling over simulated devices; and the no-batching
baseline (`--max-batch-size 1`) against dynamic batching; plus this tool's own ceiling beside
`wrk` where wrk is installed. Every server is a `clipserve` subprocess on a free loopback port.
`--quick` uses the tiny open_clip architecture the tests use and short windows (under 5 min on
2 cores); the full report uses ViT-B-32 with random weights. Results land in
`bench/results/<date>-<cpu>[-<gpu>][-quick]/` as report.md, report.json and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clipserve.loadgen.images import SourceImage, load_images
from clipserve.loadgen.loadgen import LoadSpec, run_async
from clipserve.loadgen.payloads import KINDS, ModelInput, Request, build_requests
from clipserve.loadgen.procs import clipserve_server, machine, machine_slug, tiny_model
from clipserve.loadgen.runner import PointResult, run_point
from clipserve.loadgen.server import fetch_info

SECTIONS = ("executors", "protocols", "grid", "devices", "baseline", "ceiling")
# What a section makes: its Markdown, and its data for report.json.
Section = tuple[str, object]


@dataclass
class Plan:
    quick: bool
    out: Path
    work: Path  # scratch: the tiny model's config, export caches
    model_flags: list[str] = field(default_factory=list)
    model_desc: str = ""
    log: Callable[[str], None] = print
    batched: PointResult | None = None  # the baseline's batched point, if the grid measured it

    @property
    def baseline_clients(self) -> int:
        return 16 if self.quick else 32

    @property
    def window(self) -> float:
        return 2.0 if self.quick else 10.0

    @property
    def warmup(self) -> float:
        return 0.5 if self.quick else 2.0

    def spec(self, concurrency: int, window: float | None = None) -> LoadSpec:
        return LoadSpec(
            concurrency=concurrency, duration_s=window or self.window, warmup_s=self.warmup
        )

    def server(self, *extra: str, model: bool = True) -> AbstractContextManager[str]:
        """A `clipserve` on the CPU with these flags; the block gets its URL."""
        base = [*self.model_flags] if model else []
        cache = ["--cache-dir", str(self.work / "cache")]
        return clipserve_server([*base, "--gpus", "cpu", *cache, *extra])


_SOURCES: list[SourceImage] = []


def _requests(url: str, kind: str, n: int) -> list[Request]:
    """Four distinct requests of `kind` with `n` images each, from 16 synthetic 640x480 images."""
    if not _SOURCES:
        _SOURCES.extend(load_images(None, (640, 480), 16))
    info = run_async(fetch_info(url))
    model = ModelInput.from_info(info or {})
    return build_requests(kind, _SOURCES, model, images_per_request=n, variants=4)


def _point(url: str, reqs: list[Request], spec: LoadSpec, plan: Plan) -> PointResult:
    r = run_point(url, reqs, spec)
    plan.log(
        f"    {spec.load:>6}: {r.images_per_s:9.1f} img/s  p50 {r.latency_ms.get('p50', 0):8.1f}"
        f"  p99 {r.latency_ms.get('p99', 0):8.1f} ms  batch "
        f"{(r.server or {}).get('mean_batch_size')}  errors {r.completed - r.ok}"
    )
    return r


def _md(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def executors(plan: Plan) -> Section:
    from clipserve.loadgen.offline import measure_executor

    sizes = [1, 8, 32] if plan.quick else [1, 4, 8, 16, 32, 64]
    variants = ["torch", "ort-cpu"] if plan.quick else ["torch", "ort-cpu", "torch+compile"]
    flags = dict(zip(plan.model_flags[::2], plan.model_flags[1::2], strict=True))
    base = {k.lstrip("-").replace("-", "_"): v for k, v in flags.items()}
    results = []
    for variant in variants:
        backend, _, extra = variant.partition("+")
        plan.log(f"  {variant}")
        f = {
            **base,
            "backend": backend,
            "gpus": "cpu",
            "max_batch_size": str(max(sizes)),
            "max_queue_size": str(max(sizes)),
            "max_items_per_request": "1",
            "cache_dir": str(plan.work / "cache"),
        }
        if extra == "compile":
            f["compile"] = "true"
        got = measure_executor(f, sizes, min_time_s=0.5 if plan.quick else 2.0, report=plan.log)
        results.append({"variant": variant, **got})
    headers = ["batch", *(f"{r['variant']} img/s (ms)" for r in results)]
    rows = [
        [n, *(f"{r['rows'][i]['images_per_s']} ({r['rows'][i]['latency_ms']})" for r in results)]
        for i, n in enumerate(sizes)
    ]
    text = (
        f"Offline, no HTTP: {plan.model_desc}, uint8 224x224 input normalised by the executor, "
        "each executor on its own device thread.\n\n" + _md(headers, rows)
    )
    return text, results


def protocols(plan: Plan) -> Section:
    in_flight = 64
    out = []
    with plan.server("--backend", "fake", "--max-queue-size", "512") as url:
        for name, k in KINDS.items():
            if name == "ping":
                continue
            n = 1 if k.single else 8
            reqs = _requests(url, name, n)
            spec = plan.spec(max(1, in_flight // n), plan.window)
            r = _point(url, reqs, spec, plan)
            out.append({"payload": name, "bytes_per_request": len(reqs[0].body), **r.to_dict()})
    rows = [
        [
            o["payload"],
            round(o["bytes_per_request"] / max(1, _items(o)) / 1000, 1),
            o["images_per_s"],
            o["latency_ms"].get("p50"),
            o["latency_ms"].get("p99"),
            ((o["server"] or {}).get("stage_ms") or {}).get("decode"),
            o["completed"] - o["ok"],
        ]
        for o in out
    ]
    text = (
        f"Served by `--backend fake` (no model: what each wire format costs the server), "
        f"{in_flight} images in flight, 640x480 JPEG sources, 8 per request for the list "
        "formats (text formats: 8 texts, answered by the real text tower). `decode` is the "
        "server's mean ms per request for parsing and decoding.\n\n"
        + _md(["payload", "KB/item", "items/s", "p50 ms", "p99 ms", "decode ms", "errors"], rows)
    )
    return text, out


def _items(o: dict[str, Any]) -> int:
    return 1 if KINDS[o["payload"]].single else 8


def grid(plan: Plan) -> Section:
    delays = [0.0, 10.0] if plan.quick else [0.0, 5.0, 20.0]
    concurrency = [1, 8, 32]
    cells: dict[float, list[PointResult]] = {}
    for delay in delays:
        plan.log(f"  --max-queue-delay-ms {delay:g}")
        with plan.server("--max-queue-delay-ms", str(delay)) as url:
            reqs = _requests(url, "jpeg", 1)
            cells[delay] = [_point(url, reqs, plan.spec(c), plan) for c in concurrency]
            if delay == 0 and plan.quick:  # the baseline's batched side: one server fewer
                plan.batched = _point(url, reqs, plan.spec(plan.baseline_clients), plan)
    headers = ["max queue delay", *(f"c={c}: img/s, p99 ms, batch" for c in concurrency)]
    rows = [
        [
            f"{d:g} ms",
            *(
                f"{r.images_per_s:.1f}, {r.latency_ms.get('p99', 0):.0f}, "
                f"{(r.server or {}).get('mean_batch_size')}"
                for r in cells[d]
            ),
        ]
        for d in delays
    ]
    _grid_plot(plan.out / "grid.png", concurrency, cells, plan.model_desc)
    text = (
        f"{plan.model_desc}, one 640x480 JPEG per request, closed loop; each cell: images/s, "
        "p99 latency, the server's mean batch size.\n\n"
        + _md(headers, rows)
        + "\n\n![queue delay x concurrency](grid.png)"
    )
    return text, {f"{d:g}": [r.to_dict() for r in rs] for d, rs in cells.items()}


def _grid_plot(
    path: Path, conc: list[int], cells: dict[float, list[PointResult]], title: str
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for delay, rs in cells.items():
        a.plot(conc, [r.images_per_s for r in rs], marker="o", label=f"delay {delay:g} ms")
        b.plot(conc, [r.latency_ms.get("p99", 0) for r in rs], marker="o", label=f"{delay:g} ms")
    a.set(xscale="log", xlabel="concurrency", ylabel="images/s", title="throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="p99 (ms)", title="p99")
    a.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def devices(plan: Plan) -> Section:
    counts = [1, 4] if plan.quick else [1, 2, 4]
    option = ["--backend-option", "latency_ms=20", "--backend-option", "per_item_ms=4"]
    results = []
    for n in counts:
        gpus = ",".join(str(i) for i in range(n))
        flags = ["--backend", "fake", *option, "--max-queue-size", "1024"]
        with clipserve_server(
            [*plan.model_flags, *flags, "--gpus", gpus, "--cache-dir", str(plan.work / "cache")]
        ) as url:
            reqs = _requests(url, "raw-tensor", 8)
            plan.log(f"  {n} simulated devices")
            results.append(_point(url, reqs, plan.spec(32), plan))
    base = results[0].images_per_s or 1.0
    rows = [
        [
            n,
            r.images_per_s,
            round(r.images_per_s / base, 2),
            r.latency_ms.get("p99"),
            (r.server or {}).get("mean_batch_size"),
            ", ".join(
                f"{k}: {v:g}" for k, v in ((r.server or {}).get("batches_by_device") or {}).items()
            ),
        ]
        for n, r in zip(counts, results, strict=True)
    ]
    text = (
        "`--backend fake` on simulated devices `sim:0..N-1`, each taking 20 ms + 4 ms per image "
        "per batch (so one device peaks near 216 images/s at batch 32); uint8 tensors, 8 per "
        "request, 32 clients. Shows the dispatch to N workers, not a GPU.\n\n"
        + _md(["devices", "img/s", "speed-up", "p99 ms", "mean batch", "batches per device"], rows)
    )
    return text, [r.to_dict() for r in results]


def baseline(plan: Plan) -> Section:
    c = plan.baseline_clients
    results = {}
    for label, size in (("one image per model call", "1"), ("dynamic batching (32)", "32")):
        if size == "32" and plan.batched is not None:
            results[label] = plan.batched  # measured with the grid's default server
            continue
        plan.log(f"  --max-batch-size {size}")
        with plan.server("--max-batch-size", size) as url:
            reqs = _requests(url, "jpeg", 1)
            results[label] = _point(url, reqs, plan.spec(c), plan)
    rows = [
        [
            k,
            r.images_per_s,
            r.latency_ms.get("p50"),
            r.latency_ms.get("p99"),
            (r.server or {}).get("mean_batch_size"),
        ]
        for k, r in results.items()
    ]
    a, b = results.values()
    gain = b.images_per_s / a.images_per_s if a.images_per_s else float("nan")
    text = (
        f"{plan.model_desc}, one 640x480 JPEG per request, {c} clients. Dynamic batching "
        f"serves **{gain:.2f}x** the images/s of one request per model call.\n\n"
        + _md(["server", "img/s", "p50 ms", "p99 ms", "mean batch"], rows)
    )
    if plan.quick:
        text += (
            "\n\nThe tiny model's forward pass takes a few ms, so decoding dominates and "
            "batching has little to gain here; the full report (ViT-B-32) shows what it gains "
            "when the model is the cost."
        )
    return text, {k: r.to_dict() for k, r in results.items()}


def ceiling(plan: Plan) -> Section:
    import shutil

    from clipserve.loadgen.ceiling import compare, summary_markdown

    if not shutil.which("wrk"):
        return "Skipped: `wrk` is not installed (`apt-get install wrk`).", None
    rounds = compare(
        rounds=2 if plan.quick else 3, seconds=3.0 if plan.quick else 5.0, log=plan.log
    )
    return summary_markdown(rounds), rounds


RUNNERS: dict[str, Callable[[Plan], Section]] = {
    "executors": executors,
    "protocols": protocols,
    "grid": grid,
    "devices": devices,
    "baseline": baseline,
    "ceiling": ceiling,
}
TITLES = {
    "executors": "Executors (offline)",
    "protocols": "Wire formats (served, fake backend)",
    "grid": "Queue delay x concurrency",
    "devices": "Device scaling (simulated devices)",
    "baseline": "No batching vs dynamic batching",
    "ceiling": "The load generator's own ceiling",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clipserve-bench report", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short windows (< 5 min)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="parent directory")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in chosen if s not in RUNNERS]:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    out = args.out / f"{stamp}-{machine_slug()}{'-quick' if args.quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "machine": machine(),
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    sections_md: list[str] = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="clipserve-bench-") as work:
        plan = Plan(args.quick, out, Path(work), log=lambda s: print(s, flush=True))
        if args.quick:
            # One torch thread: the client shares this machine's cores with the server.
            tiny = str(tiny_model(Path(work)))
            plan.model_flags = ["--model", tiny, "--pretrained", "none", "--threads", "1"]
            plan.model_desc = (
                "tiny open_clip architecture (2 layers, width 64; random weights; 1 torch thread)"
            )
        else:
            plan.model_flags = ["--model", "ViT-B-32", "--pretrained", "none"]
            plan.model_desc = "ViT-B-32 (random weights), torch fp32 on CPU"
        for name in chosen:
            print(f"== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                text, data = RUNNERS[name](plan)
            except Exception as e:  # a failed section is reported; the others still run
                failed += 1
                traceback.print_exc()
                text, data = f"**Failed**: `{type(e).__name__}: {e}`", {"error": repr(e)}
            took = time.perf_counter() - t0
            doc[name] = {"seconds": round(took, 1), "data": data}
            sections_md.append(f"## {TITLES[name]}\n\n{text}\n\n_{took:.0f} s_\n")
    m = doc["machine"]
    gpus = ", ".join(m["gpus"]) or "no GPU"
    head = (
        f"# clipserve benchmark report{' (quick)' if args.quick else ''}\n\n"
        f"{doc['time']} on {m['cpu']}, {m['cores']} cores, {gpus}; {m['system']}, Python "
        f"{m['python']}. Model: {plan.model_desc}. Client and servers share this machine. "
        f"Total {time.perf_counter() - started:.0f} s. Regenerate with "
        f"`clipserve-bench report{' --quick' if args.quick else ''}`.\n"
    )
    (out / "report.md").write_text(head + "\n" + "\n".join(sections_md))
    (out / "report.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {out / 'report.md'} ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
