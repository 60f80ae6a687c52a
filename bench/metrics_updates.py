"""One request's metric updates, CPU per request: prometheus_client one at a time (the old path)
against clipserve's deferred updates (clipserve/deferred_metrics.py), in one process and with
prometheus_client's multiprocess files (--workers N), in interleaved rounds.

    python -m bench.metrics_updates [--rounds 7] [--out bench/results/metrics-updates.json]

A request's updates are the observer's (2), the model statistics' (9) and the per-protocol
ones (7): what a 200 tensor request to /embed makes. "deferred, flushed every k" flushes after
every k requests, as a loop iteration that finishes k requests does under --workers N (in one
process they wait for a read). Each mode runs in its own child (prometheus_client picks its value
class at import).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, spread, write_report

STAGES = ("receive", "decode", "queue", "compute", "encode")
MODES = ("direct", "deferred, flushed every 1", "deferred, flushed every 8", "deferred, read-time")


def _child(mode: str, n: int) -> float:
    """µs per request of `mode`, in this process."""
    from clipserve.http.children import Children
    from clipserve.metrics import Metrics

    m = Metrics()
    d = m.deferred
    d.every_iteration = False  # no loop here: this loop's `flush` calls stand for its turns
    requests = Children(m.requests)("/embed", "200")
    duration = Children(m.request_duration)("/embed")
    outcome = Children(m.model_requests)("image", "success")
    seconds = Children(m.model_request_seconds)("image", "success")
    stage_s = [Children(m.model_stage_seconds)("image", s) for s in STAGES]
    items = Children(m.model_items)("image")
    last = Children(m.model_last_inference)("image")
    stage_h = [Children(m.stage_duration)(s, "native") for s in STAGES]
    sent = Children(m.request_bytes)("native")
    answered = Children(m.response_bytes)("native")

    def direct() -> None:
        requests.inc()
        duration.observe(0.0021)
        outcome.inc()
        seconds.inc(0.002)
        for c in stage_s:
            c.inc(0.0003)
        items.inc(1)
        last.set(time.time())
        for h in stage_h:
            h.observe(0.0003)
        sent.inc(150528)
        answered.inc(9000)

    def deferred() -> None:
        with d:
            d.add(requests)
            d.observe(duration, 0.0021)
        with d:
            d.add(outcome)
            d.add(seconds, 0.002)
            for c in stage_s:
                d.add(c, 0.0003)
            d.add(items, 1)
            d.set(last, time.time())
        with d:
            for h in stage_h:
                d.observe(h, 0.0003)
            d.add(sent, 150528)
            d.add(answered, 9000)

    # Flushed after every k requests; read-time and direct: once, after the last.
    every = int(mode.rsplit(" ", 1)[1]) if mode.startswith("deferred, flushed every") else 0
    one = direct if mode == "direct" else deferred
    t0 = time.perf_counter()
    for i in range(n):
        one()
        if every and (i + 1) % every == 0:
            d.flush()
    d.flush()
    return (time.perf_counter() - t0) / n * 1e6


def _run(mode: str, multiprocess: bool, n: int) -> float:
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with tempfile.TemporaryDirectory() as files:
        if multiprocess:
            env["PROMETHEUS_MULTIPROC_DIR"] = files
        code = f"from bench.metrics_updates import _child; print(_child({mode!r}, {n}))"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
        )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    runs: dict[str, dict[str, list[float]]] = {"one process": {}, "multiprocess files": {}}
    for _ in range(a.rounds):
        for where, mp in (("one process", False), ("multiprocess files", True)):
            for mode in MODES:
                runs[where].setdefault(mode, []).append(_run(mode, mp, a.requests))
    result: dict[str, object] = {
        "benchmark": "a request's 18 metric updates, µs of CPU per request (issue 23)",
        "machine": machine(),
        "rounds": a.rounds,
        "requests_per_run": a.requests,
    }
    for where, modes in runs.items():
        direct = modes["direct"]
        result[where] = {
            mode: {
                "us_per_request": spread(values, 3),
                "ratio_to_direct": spread([v / d for v, d in zip(values, direct, strict=True)], 3),
            }
            for mode, values in modes.items()
        }
    write_report(result, a.out)


if __name__ == "__main__":
    main()
