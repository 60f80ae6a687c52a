"""Large tensor bodies through one clipserve process: page faults, CPU and system time per
request, checkouts side by side.

Each request carries 64 uint8 224x224 tensors (9.6 MB, clipserve-bench's raw-tensor payload) to
`clipserve --workers 1` with the fake backend (compute=0: the server's own work), 8 requests in
flight. Per round, each checkout in turn starts a server, takes a warm-up, and is measured over a
window: the server process's minor page faults and CPU time (user and system, /proc) over the
requests answered in it. Page faults do not drift with the machine's speed; CPU time does, so
rounds interleave the checkouts and the per-round ratio is what is compared.

    python -m bench.large_bodies --tree before=/tmp/cs-before --tree after=. --rounds 6 \
        --out bench/results/large-bodies.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO, machine, rotated, say, spread, utc_now, write_report
from bench.frontend.servers import fake_flags
from clipserve.loadgen.procs import TINY_CONFIG, clipserve_process

IMAGES = 64
CONCURRENCY = 8


def counters(pid: int) -> tuple[int, float, float]:
    """Minor page faults, user and system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[7]), int(fields[11]) / tick, int(fields[12]) / tick


def load(url: str, seconds: float, out: Path) -> dict[str, int]:
    """clipserve-bench's closed loop; the statuses it counted."""
    cmd = [sys.executable, "-m", "clipserve.loadgen", "--url", url, "-q"]
    cmd += ["--payload", "raw-tensor", "-b", str(IMAGES), "-c", str(CONCURRENCY)]
    cmd += ["--duration", str(seconds), "--warmup", "0", "--json", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    statuses: dict[str, int] = json.loads(out.read_text())["results"][0]["statuses"]
    return statuses


def measure(tree: Path, model: Path, seconds: float) -> dict[str, Any]:
    flags = [*fake_flags(model), "--max-body-bytes-in-flight", str(1 << 30)]
    flags += ["--max-queue-size", "4096"]
    with clipserve_process(flags, cwd=tree, stdout=subprocess.DEVNULL) as (proc, url):
        load(url, 3.0, model.with_name("warm-up.json"))  # the heap reaches its working size
        f0, u0, s0 = counters(proc.pid)
        statuses = load(url, seconds, model.with_name("window.json"))
        f1, u1, s1 = counters(proc.pid)
    n = sum(statuses.values())
    return {
        "requests": n,
        "statuses": statuses,
        "requests_per_s": round(n / seconds, 1),
        "faults_per_request": round((f1 - f0) / n, 1),
        "cpu_ms_per_request": round((u1 - u0 + s1 - s0) * 1000 / n, 3),
        "sys_ms_per_request": round((s1 - s0) * 1000 / n, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="name=path of a checkout")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    a = parser.parse_args()
    trees = [(n, Path(p).resolve()) for n, p in (t.split("=", 1) for t in a.tree)]
    trees = trees or [("now", REPO)]
    model = Path(tempfile.mkdtemp()) / "tiny-clip.json"
    model.write_text(json.dumps(TINY_CONFIG))
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for name, tree in rotated(trees, r):
            row = {"round": r, "tree": name, **measure(tree, model, a.seconds)}
            say(f"round {r} {name}: {row}")
            rows.append(row)
    keys = ("faults_per_request", "cpu_ms_per_request", "sys_ms_per_request", "requests_per_s")
    summary: dict[str, Any] = {
        name: {k: spread([x[k] for x in rows if x["tree"] == name], 3) for k in keys}
        for name, _ in trees
    }
    if len(trees) == 2:
        (first, _), (last, _) = trees
        by = {(x["round"], x["tree"]): x for x in rows}
        ratios = [
            by[r, last]["cpu_ms_per_request"] / by[r, first]["cpu_ms_per_request"]
            for r in range(a.rounds)
        ]
        summary[f"cpu_per_request_{last}_over_{first}"] = spread(ratios, 3)
    report = {
        "benchmark": "large-bodies",
        "time": utc_now(),
        "machine": machine(),
        "load": f"{IMAGES} uint8 224x224 tensors a request (9.6 MB), {CONCURRENCY} in flight, "
        f"clipserve-bench closed loop, {a.seconds} s windows after a 3 s warm-up",
        "server": "clipserve --workers 1, fake backend compute=0, tiny model",
        "trees": {name: str(tree) for name, tree in trees},
        "summary": summary,
        "rows": rows,
    }
    write_report(report, a.out)


if __name__ == "__main__":
    main()
