"""The cost section: CPU per request of every server process at saturation, beside the floor,
JPEG decode measured offline as its own share, and a py-spy profile of each variant."""

from __future__ import annotations

import argparse
import contextlib
import functools
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import REPO, rotated, say
from bench.frontend.load import clean, client, requests_of, saturate, spread
from bench.frontend.profile import profile
from bench.frontend.servers import (
    Server,
    affinity,
    bare,
    clipserve,
    direct,
    fake_flags,
    floor,
    floor_kept,
    pinning,
    pytriton,
    split_cpus,
    start_all,
)
from clipserve.inference.preprocess import ImageDecoder
from clipserve.loadgen.payloads import ModelInput, Request

Rows = list[dict[str, Any]]
FLOORS = ("floor", "floor-kept")  # servers the others are measured against


def decode_cost(jpegs: Sequence[Request], repeat: int = 60) -> float:
    """CPU ms to decode one of the JPEGs to a 224x224 crop, here (as the server's pool would)."""
    decoder = ImageDecoder(ModelInput.from_info({}).spec, 10**8)
    decoder(jpegs[0].body)
    t0 = time.process_time()
    for i in range(repeat):
        decoder(jpegs[i % len(jpegs)].body)
    return (time.process_time() - t0) / repeat * 1000


def section_cost(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    server_cpus, client_cpus = split_cpus(a.client_cores)
    payloads = {"tensor": "raw-tensor", "jpeg": "jpeg"}
    kinds = {k: requests_of(payloads[k]) for k in a.payloads}
    servers = [floor(), floor_kept()] + [
        clipserve(f"clipserve-w{n}", [*fake_flags(model), "--workers", str(n)], a.cost_tree)
        for n in a.cost_workers
    ]
    if a.cost_bare:
        servers.insert(1, bare())
    if a.cost_direct:
        servers.append(direct(model))
    skipped_early: dict[str, str] = {}
    if "tensor" in kinds:  # Triton's front end beside them, where its interpreter is set up
        python = a.pytriton_python or (REPO / ".pytriton" / "bin" / "python")
        if Path(python).exists():
            servers.append(pytriton(str(python), kinds["tensor"]))
        else:
            skipped_early["pytriton"] = f"no PyTriton interpreter at {python}: make pytriton-env"
    if a.cost_before_tree:  # its fake must know compute=0
        servers += [
            clipserve(f"before-w{n}", [*fake_flags(model), "--workers", str(n)], a.cost_before_tree)
            for n in a.cost_before_workers
        ]
    rows: Rows = []
    threads = len(client_cpus or {0})
    with contextlib.ExitStack() as stack, affinity(client_cpus):
        up, skipped = start_all(stack, servers, server_cpus)
        skipped.update(skipped_early)
        for r in up:  # warm-up: connections, caches, the batcher's first batches
            for reqs in _kinds(r.server, kinds).values():
                saturate(r, reqs, 1.0, a.connections, threads)
        decode: list[float] = []  # per round, on the server's cores between load points
        for rnd in range(a.rounds):
            with affinity(server_cpus):
                decode.append(decode_cost(kinds["jpeg"]) if "jpeg" in kinds else 0.0)
            for r in rotated(up, rnd):
                for kind, reqs in _kinds(r.server, kinds).items():
                    point = saturate(r, reqs, a.seconds, a.connections, threads)
                    row = {"round": rnd, "payload": kind, **point}
                    rows.append(row)
                    say(
                        f"cost round {rnd} {r.server.name} {kind}: "
                        f"{row['requests_per_s']} req/s, "
                        f"{row['server_cpu_ms_per_request']} CPU ms/req"
                    )
    summary = {
        f"{r.server.name} {kind}": _summary(rows, r.server.name, kind, decode)
        for r in up
        for kind in _kinds(r.server, kinds)
    }
    profiles = {}
    if a.profile_seconds > 0 and set(a.profile_payloads) <= set(kinds):
        cpus = (server_cpus, client_cpus)
        profiled = [s for s in servers[1:] if s.name not in skipped and s.clipserve]
        profiles = _profiles(a, profiled, cpus, {k: kinds[k] for k in a.profile_payloads})
    return {
        "pinning": pinning(server_cpus, client_cpus),
        "client": client(),
        "connections": a.connections,
        "seconds_per_point": a.seconds,
        "decode_cpu_ms_per_jpeg_offline": spread(decode),
        "skipped": skipped,
        "summary_medians": summary,
        "ratios": _ratios(rows, [r.server.name for r in up], list(kinds)),
        "rows": rows,
        "profiles": profiles,
    }


def _kinds(server: Server, kinds: dict[str, list[Request]]) -> dict[str, list[Request]]:
    """The payload kinds a server takes, as its own requests where it has them."""
    if server.requests is None:
        return kinds
    return {k: server.requests[k] for k in kinds if k in server.requests}


def _ratios(rows: Rows, servers: list[str], kinds: list[str]) -> dict[str, Any]:
    """Each server's requests/s and CPU per request over each floor's, and --workers 2's over
    --workers 1's of the same tree, per round (the two measured minutes apart at most), as
    medians with spread."""
    by = {(x["server"], x["payload"], x["round"]): x for x in rows if clean(x)}
    rounds = sorted({x["round"] for x in rows})
    floors = [f for f in FLOORS if f in servers]
    pairs = [(s, f) for f in floors for s in servers if s not in floors]
    pairs += [(s, s[:-1] + "1") for s in servers if s.endswith("-w2") and s[:-1] + "1" in servers]
    out: dict[str, Any] = {}
    for kind in kinds:
        for num, den in pairs:
            both = [
                (by[num, kind, r], by[den, kind, r])
                for r in rounds
                if (num, kind, r) in by and (den, kind, r) in by
            ]
            for field, label in (
                ("requests_per_s", "requests/s"),
                ("server_cpu_ms_per_request", "CPU per request"),
            ):
                out[f"{num} / {den} {kind} {label}"] = spread(
                    [n[field] / d[field] for n, d in both]
                )
    return out


def _summary(rows: Rows, server: str, kind: str, decode: list[float]) -> dict[str, Any]:
    """One server's medians for one payload kind, over the rounds without failures; beside the
    floor, the event loop's side: its CPU less the JPEG decode measured offline that round."""
    mine = [x for x in rows if x["server"] == server and x["payload"] == kind and clean(x)]
    floors = {x["round"]: x for x in rows if x["server"] == "floor" and x["payload"] == kind}
    ms = [x["server_cpu_ms_per_request"] for x in mine]
    entry: dict[str, Any] = {
        "cpu_ms_per_request": spread(ms),
        "requests_per_s": spread([x["requests_per_s"] for x in mine]),
    }
    if server in FLOORS:
        return entry
    own = [
        x["server_cpu_ms_per_request"] - (decode[x["round"]] if kind == "jpeg" else 0) for x in mine
    ]
    over_floor = [
        o / floors[x["round"]]["server_cpu_ms_per_request"] for o, x in zip(own, mine, strict=True)
    ]
    entry["event_loop_side_ms_per_request"] = spread(own)
    entry["event_loop_side_over_floor"] = spread(over_floor)
    roles = sorted({k for x in mine for k in x.get("cpu_ms_per_request_by_role", {})})
    entry["cpu_ms_per_request_by_role"] = {
        k: spread([x["cpu_ms_per_request_by_role"].get(k, 0.0) for x in mine]) for k in roles
    }
    entry["executor_wall_ms_per_request"] = spread(
        [x.get("executor_wall_ms_per_request", 0.0) for x in mine]
    )
    if kind == "jpeg":
        entry["decode_share_of_cpu"] = spread(
            [decode[x["round"]] / x["server_cpu_ms_per_request"] for x in mine]
        )
    return entry


def _profiles(
    a: argparse.Namespace,
    servers: list[Server],
    cpus: tuple[set[int] | None, set[int] | None],
    kinds: dict[str, list[Request]],
) -> dict[str, Any]:
    """A py-spy profile of each server at saturation, per payload kind; an error in place of
    one that could not be taken."""
    threads = len(cpus[1] or {0})
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in servers:
            for kind, reqs in kinds.items():
                say(f"profiling {s.name} {kind}")
                point = functools.partial(
                    saturate,
                    reqs=reqs,
                    seconds=a.profile_seconds,
                    connections=a.connections,
                    threads=threads,
                )
                path = Path(tmp) / f"{s.name}-{kind}.txt"
                try:
                    out[f"{s.name} {kind}"] = profile(s, cpus, point, path)
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    out[f"{s.name} {kind}"] = {"error": str(e)}
    return out
