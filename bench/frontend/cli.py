"""`python -m bench.frontend`: the flags, the sections in order, one JSON written as it goes."""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench.frontend
from bench.common import REPO, machine, say, utc_now
from bench.frontend.batching import section_batching
from bench.frontend.cost import section_cost
from bench.frontend.policy import section_policy
from bench.frontend.scaling import section_scaling
from clipserve.loadgen.procs import TINY_CONFIG, machine_slug

SECTIONS = ("cost", "batching", "scaling", "regression", "policy")
# The fake answers a 512-float embedding, as ViT-B-32 does and the floor does.
FAKE_CONFIG = {**TINY_CONFIG, "embed_dim": 512}

RUNNERS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "cost": section_cost,
    "batching": section_batching,
    "scaling": section_scaling,
    "policy": section_policy,
}


def parser() -> argparse.ArgumentParser:
    assert bench.frontend.__doc__
    p = argparse.ArgumentParser(
        prog="python -m bench.frontend", description=bench.frontend.__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="one round, short points")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="any of " + ",".join(SECTIONS) + " (regression runs with policy)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="per saturation point")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--client-cores", type=int, default=1)
    p.add_argument("--cost-workers", default="1,2", help="front ends of the cost section")
    p.add_argument("--profile-seconds", type=float, default=5.0, help="0: no py-spy profile")
    p.add_argument("--profile-payloads", default="tensor")
    p.add_argument("--batching-workers", type=int, default=2)
    p.add_argument("--batching-rate", type=float, default=200.0, help="requests/s, open loop")
    p.add_argument("--batch-latency-ms", type=float, default=20.0)
    p.add_argument("--workers-list", default="1,2")
    p.add_argument(
        "--scaling-reuse-port",
        action="store_true",
        help="scaling section: each count above one also with --reuse-port (wNr)",
    )
    p.add_argument("--before-tree", type=Path, help="a checkout of the commit before issue 8")
    p.add_argument(
        "--cost-before-tree", type=Path, help="cost section: also a checkout with fake compute=0"
    )
    p.add_argument(
        "--cost-before-workers", default="1", help="front ends of the --cost-before-tree servers"
    )
    p.add_argument(
        "--cost-bare",
        action="store_true",
        help="cost section: also the floor's answer from a bare httptools protocol (no ASGI)",
    )
    p.add_argument(
        "--cost-direct",
        action="store_true",
        help="cost section: also clipserve's /embed endpoint under a bare protocol (no ASGI)",
    )
    p.add_argument(
        "--cost-tree", type=Path, help="cost section: the checkout measured (default: this one)"
    )
    p.add_argument("--payloads", default="tensor,jpeg", help="cost section: tensor, jpeg")
    p.add_argument(
        "--pytriton-python",
        type=Path,
        help="cost section: the interpreter with PyTriton (default .pytriton/bin/python, "
        "made by make pytriton-env); Triton's front end is measured where it exists",
    )
    p.add_argument("--delays", default="0,5,10", help="--max-queue-delay-ms values")
    p.add_argument("--policy-seconds", type=float, default=8.0)
    p.add_argument("--out", type=Path)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    a = parser().parse_args(argv)
    if a.quick:
        a.rounds, a.seconds, a.profile_seconds, a.policy_seconds = 1, 2.0, 3.0, 3.0
    a.cost_workers = [int(x) for x in a.cost_workers.split(",")]
    a.cost_before_workers = [int(x) for x in a.cost_before_workers.split(",")]
    a.payloads = [x for x in a.payloads.split(",") if x]
    a.workers_list = [int(x) for x in a.workers_list.split(",")]
    a.delays = [float(x) for x in a.delays.split(",") if x]
    a.profile_payloads = [x for x in a.profile_payloads.split(",") if x]
    a.sections = [s.strip() for s in a.sections.split(",")]
    if "regression" in a.sections and "policy" not in a.sections:
        a.sections.append("policy")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    git = ["git", "describe", "--always", "--dirty"]
    result: dict[str, Any] = {
        "benchmark": "front ends (--workers N)",
        "date": utc_now(),
        "machine": machine(),
        "note": "shared machine: other work ran beside it; points vary about ±20% run to run",
        "rounds": a.rounds,
        "git": subprocess.run(git, cwd=REPO, capture_output=True, text=True).stdout.strip(),
    }
    name = f"frontend-{time.strftime('%Y-%m-%d')}-{machine_slug()}{'-quick' if a.quick else ''}"
    out = a.out or REPO / "bench" / "results" / f"{name}.json"
    with tempfile.TemporaryDirectory() as tmp:
        fake_model, tiny_model = Path(tmp) / "fake-512.json", Path(tmp) / "tiny.json"
        fake_model.write_text(json.dumps(FAKE_CONFIG))
        tiny_model.write_text(json.dumps(TINY_CONFIG))
        for section in (s for s in SECTIONS if s in a.sections and s in RUNNERS):
            say(f"section {section}")
            model = tiny_model if section == "policy" else fake_model
            result[section] = RUNNERS[section](a, model)
            out.write_text(json.dumps(result, indent=2) + "\n")  # a partial run still reports
    medians = {
        k: v.get("summary_medians", v) if isinstance(v, dict) else v for k, v in result.items()
    }
    print(json.dumps(medians, indent=1)[:6000])
    say(f"wrote {out}")
