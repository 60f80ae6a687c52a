"""Where the process hop's CPU goes (issue 23): `perf record` (software clock, every thread) of
`--workers 1` and of `--workers 2`'s processes at saturation on one core, tensor requests from
wrk on the other, as `bench.workers_hop` loads them; each process's samples as µs per request,
by shared object and by symbol, medians over interleaved rounds.

The question it answers: does a front end cost more than `--workers 1` because it does more
(frames, a copy into its slot), or because the same work runs slower beside two other processes
on one core? Work both do alike (orjson's encoding, httptools' parsing, the kernel's copy of the
body) is compared by name in `same_work`.

    python -m bench.workers_perf --rounds 3 --seconds 5 --out bench/results/workers-perf.json

Needs `perf` (linux-perf) with user-space sampling allowed (perf_event_paranoid <= 2).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import write_report
from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.load import saturate, spread
from bench.frontend.servers import Running, clipserve, fake_flags, role
from bench.workers_hop import one_core_rounds, report_head

HZ = 2000  # samples a second of CPU: 500 µs each
ROLES = ("server", "front end", "engine")
# Work `--workers 1` and a front end do alike, per request.
SAME_WORK = {
    "orjson (the JSON answer)": ("dso", "orjson.cpython-311-x86_64-linux-gnu.so"),
    "httptools (parsing the request)": ("dso", "parser.cpython-311-x86_64-linux-gnu.so"),
    "kernel copy of the body to user space": ("sym", "[k] _copy_to_iter"),
}


def _report(data: Path) -> dict[str, dict[str, float]]:
    """Samples by shared object ("dso") and by symbol ("sym") in one perf.data."""
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "period"],
        capture_output=True,
        text=True,
        check=True,
    )
    samples = len(script.stdout.split())
    by: dict[str, dict[str, float]] = {}
    for key in ("dso", "sym"):
        out = subprocess.run(
            ["perf", "report", "-i", str(data), "--no-children", "--sort", key, "-g", "none", "-q"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        by[key] = {}
        for line in out.splitlines():
            if m := re.match(r"\s*([\d.]+)%\s+(.*\S)", line):
                by[key][m.group(2)] = float(m.group(1)) / 100 * samples
    return by


def point(
    r: Running, seconds: float, reqs: Any, connections: int, threads: int, tmp: Path
) -> dict[str, Any]:
    procs = [p for p in [r.root, *r.root.children(recursive=True)] if role(p, r.root) in ROLES]
    records = []
    for p in procs:
        data = tmp / f"{r.server.name}-{p.pid}.data"
        cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(HZ), "-o", str(data)]
        cmd += ["-p", str(p.pid), "--", "sleep", str(seconds + 1)]
        records.append((role(p, r.root), data, subprocess.Popen(cmd)))
    row = saturate(r, reqs, seconds, connections, threads)
    ok = max(row["requests"] - row["failed"], 1)
    by: dict[str, dict[str, dict[str, float]]] = {}
    for label, data, proc in records:
        proc.wait()
        for key, samples in _report(data).items():
            mine = by.setdefault(label, {}).setdefault(key, defaultdict(float))
            for name, n in samples.items():
                mine[name] += n / ok * 1e6 / HZ  # µs a request
        data.unlink()
    return {
        "server": r.server.name,
        "requests_per_s": row["requests_per_s"],
        "us_per_request": {k: round(sum(v["dso"].values()), 1) for k, v in by.items()},
        # The same from the processes' CPU times over the load alone (perf's window is a
        # little longer): a check on the sampled figures.
        "cpu_us_per_request": {
            k: round(v * 1000, 1) for k, v in row["cpu_ms_per_request_by_role"].items() if k in by
        },
        "by": {k: {key: dict(v[key]) for key in v} for k, v in by.items()},
    }


def summarise(rows: list[dict[str, Any]], top: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sorted({x["server"] for x in rows}):
        rounds = [x for x in rows if x["server"] == name]
        out[name] = {"requests_per_s": spread([x["requests_per_s"] for x in rounds])}
        for label in sorted({k for x in rounds for k in x["by"]}):
            mine = [x for x in rounds if label in x["by"]]  # a role perf missed in a round
            entry: dict[str, Any] = {
                "us_per_request": spread([x["us_per_request"][label] for x in mine]),
                "cpu_us_per_request": spread(
                    [c[label] for x in mine if label in (c := x["cpu_us_per_request"])]
                ),
            }
            for key, n in (("dso", 8), ("sym", top)):
                totals: dict[str, float] = defaultdict(float)
                for x in mine:
                    for k, v in x["by"][label][key].items():
                        totals[k] += v
                names = sorted(totals, key=lambda k: -totals[k])[:n]
                entry[f"by_{key}"] = {
                    k: round(
                        sorted(x["by"][label][key].get(k, 0.0) for x in mine)[len(mine) // 2], 1
                    )
                    for k in names
                }
            out[name][label] = entry
    return out


def same_work(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round, a front end's µs a request on each shared piece of work over `--workers 1`'s."""
    ratios: dict[str, list[float]] = defaultdict(list)
    for rnd in sorted({x["round"] for x in rows}):
        got = {x["server"]: x for x in rows if x["round"] == rnd}
        if {"w1", "w2"} - set(got):
            continue
        for what, (key, name) in SAME_WORK.items():
            w1 = got["w1"]["by"]["server"][key].get(name, 0.0)
            fe = got["w2"]["by"].get("front end", {}).get(key, {}).get(name, 0.0)
            if w1:
                ratios[what].append(fe / w1)
    return {k: spread(v) for k, v in ratios.items()}


def paired(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round, `--workers 2`'s µs a request (its front ends; all its processes) over
    `--workers 1`'s."""
    fronts, whole = [], []
    for rnd in sorted({x["round"] for x in rows}):
        got = {x["server"]: x["us_per_request"] for x in rows if x["round"] == rnd}
        if {"w1", "w2"} <= set(got) and got["w1"].get("server"):
            w1 = got["w1"]["server"]
            fronts.append(got["w2"].get("front end", 0.0) / w1)
            whole.append(sum(got["w2"].values()) / w1)
    return {"front ends / w1": spread(fronts), "w2 / w1": spread(whole)}


def run(a: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    servers = [clipserve(f"w{n}", [*fake_flags(model), "--workers", str(n)]) for n in (1, 2)]
    rows, skipped, pins = one_core_rounds(
        servers,
        a.rounds,
        a.connections,
        lambda r, reqs, threads: point(r, a.seconds, reqs, a.connections, threads, tmp),
        lambda row: f"{row['us_per_request']} µs/request",
    )
    return {
        **report_head("workers_perf", pins, a),
        "sampling": f"perf record -e cpu-clock -F {HZ}, every thread of each process",
        "skipped": skipped,
        "same_work_front_end_over_w1": same_work(rows),
        "paired_us_per_request": paired(rows),
        "summary_medians": summarise(rows, a.top),
        "note": a.note,
        "rows": [{k: v for k, v in x.items() if k != "by"} for x in rows],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.workers_perf", description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=5)  # wrk takes whole seconds
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--top", type=int, default=30, help="symbols kept in the summary")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("needs perf on PATH (Debian: linux-perf)")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "fake-512.json"
        model.write_text(json.dumps(FAKE_CONFIG))
        write_report(run(a, model, Path(tmp)), a.out)


if __name__ == "__main__":
    main()
