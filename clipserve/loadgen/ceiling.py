"""`clipserve-bench ceiling`: how many requests/s this tool can generate, beside `wrk`.

A trivial ASGI endpoint (uvicorn, uvloop + httptools; a fixed 2-byte answer) runs pinned to
one core and the client to another; `wrk` and clipserve-bench take turns against it for a few
interleaved rounds, closed loop on 64 connections. Their ratio is how far below a C load
generator this one saturates: a server faster than that must be driven with `--procs`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipserve.loadgen.procs import free_port, pin, stop

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

CONNECTIONS = 64


async def trivial_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the body, answers `{}`: nothing for the server to do but HTTP."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"{}"})


def _cpus() -> tuple[set[int] | None, set[int] | None]:
    """Server on the first core, clients on the rest (no pinning on one core)."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return {cores[0]}, set(cores[1:])


@contextlib.contextmanager
def trivial_server(cpus: set[int] | None) -> Iterator[str]:
    port = free_port()
    code = (
        "import uvicorn; uvicorn.run('clipserve.loadgen.ceiling:trivial_app', host='127.0.0.1',"
        f" port={port}, log_level='warning', loop='uvloop', http='httptools')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=pin(cpus))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                import urllib.request

                urllib.request.urlopen(url + "/", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("trivial server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        stop(proc)


def run_wrk(url: str, seconds: float, cpus: set[int] | None) -> tuple[float, float]:
    """wrk's requests/s, and the CPU it used as a fraction of one core."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds:g}s", url + "/healthz"],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=pin(cpus),
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / seconds
    match = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    if not match:
        raise RuntimeError(f"unexpected wrk output: {out[:300]}")
    return float(match.group(1)), cpu


def run_ours(url: str, seconds: float, cpus: set[int] | None, procs: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [
            sys.executable,
            "-m",
            "clipserve.loadgen",
            "--url",
            url,
            "--payload",
            "ping",
            "--concurrency",
            str(CONNECTIONS),
            "--duration",
            str(seconds),
            "--warmup",
            "0.5",
            "--procs",
            str(procs),
            "--quiet",
            "--json",
            str(path),
        ]
        subprocess.run(cmd, check=True, capture_output=True, preexec_fn=pin(cpus))
        result: dict[str, Any] = json.loads(path.read_text())["results"][0]
    return result


def compare(
    rounds: int = 3, seconds: float = 5.0, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    if not shutil.which("wrk"):
        raise RuntimeError("wrk is not installed (apt-get install wrk)")
    server_cpus, client_cpus = _cpus()
    out = []
    with trivial_server(server_cpus) as url:
        run_wrk(url, 1, client_cpus)  # warm the server up
        for i in range(rounds):
            # Alternate who goes first: the machine is shared and drifts.
            order = ("wrk", "ours") if i % 2 == 0 else ("ours", "wrk")
            row: dict[str, Any] = {"round": i + 1}
            for who in order:
                if who == "wrk":
                    rps, cpu = run_wrk(url, seconds, client_cpus)
                    row["wrk_rps"], row["wrk_cpu"] = round(rps, 1), round(cpu, 3)
                else:
                    ours = run_ours(url, seconds, client_cpus)
                    row["ours_rps"] = ours["requests_per_s"]
                    row["ours_p50_ms"] = ours["latency_ms"].get("p50")
                    row["ours_client_cpu"] = ours["client_cpu"]
                    row["ours_warnings"] = ours["warnings"]
            row["ratio"] = round(row["ours_rps"] / row["wrk_rps"], 3)
            # Per core-second of client CPU: what each would reach with a core to itself.
            row["wrk_per_cpu"] = round(row["wrk_rps"] / max(row["wrk_cpu"], 1e-3))
            row["ours_per_cpu"] = round(row["ours_rps"] / max(sum(row["ours_client_cpu"]), 1e-3))
            log(
                f"  round {i + 1}: wrk {row['wrk_rps']:,.0f} req/s, clipserve-bench "
                f"{row['ours_rps']:,.0f} req/s ({row['ratio']:.2f}x)"
            )
            out.append(row)
    return out


def summary_markdown(rounds: list[dict[str, Any]]) -> str:
    lines = [
        f"A trivial endpoint (uvicorn, uvloop + httptools, answer `{{}}`) pinned to one core; "
        f"each client pinned to the other; closed loop, {CONNECTIONS} connections, interleaved "
        "rounds.\n",
        "| round | wrk req/s | clipserve-bench req/s | ratio | client CPU (wrk, ours) | "
        "req per client CPU-second (wrk, ours) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rounds:
        cpu = ", ".join(f"{c:.0%}" for c in [r["wrk_cpu"], *r["ours_client_cpu"]])
        lines.append(
            f"| {r['round']} | {r['wrk_rps']:,.0f} | {r['ours_rps']:,.0f} | {r['ratio']:.2f} | "
            f"{cpu} | {r['wrk_per_cpu']:,}, {r['ours_per_cpu']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="clipserve-bench ceiling", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        rounds = compare(args.rounds, args.seconds)
    except RuntimeError as e:
        print(f"clipserve-bench ceiling: {e}", file=sys.stderr)
        return 2
    print(summary_markdown(rounds))
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=2) + "\n")
    return 0
