"""CPU seconds of a served clipserve's processes by role, read from /proc (Linux; the GPU hosts'
image has no psutil): so a served section can say whether the engine's loop, the front ends or
the device ran out first.

The roles, as bench/frontend/servers.py tells them apart: the root process (the supervisor under
--workers N, else the one server), the front ends (the children that hold a listening socket on
the server's port: the shared one, or their own with --reuse-port) and the engine (the other
child, not multiprocessing's resource tracker), each with its descendants. The engine's event
loop runs on its main thread, whose id is its pid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(path: Path) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which may hold spaces), or None if gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _cpu_s(path: Path) -> float:
    fields = _stat_fields(path)
    # utime and stime are the 14th and 15th fields; these start at the 3rd.
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _TICK


def children_of() -> dict[int, list[int]]:
    """Every process's children, by parent id."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry / "stat")
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _subtree(pid: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(cols[9])
    return inodes


def _holds(pid: int, inodes: set[str]) -> bool:
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


@dataclass
class Snapshot:
    """CPU seconds so far: by role (and the processes each counted), each engine thread's,
    and the whole host's."""

    by_role: dict[str, float] = field(default_factory=dict)
    pids: dict[str, set[int]] = field(default_factory=dict)
    engine_threads: dict[int, float] = field(default_factory=dict)
    engine_pid: int = 0
    host_s: float = 0.0


def _cmdline(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def host_busy_s() -> float:
    """Seconds all the host's CPUs spent on anything but idle and I/O wait (/proc/stat)."""
    try:
        first = (PROC / "stat").read_text().splitlines()[0].split()
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


def snapshot(root: int, port: int, others: dict[str, int] | None = None) -> Snapshot:
    """The root's own CPU, and each child's with everything below it: a child that holds the
    port is a front end, multiprocessing's resource tracker is "other", and any other child of
    a root with front ends is the engine (with one front end, the root serves, and its
    children are "other"). `others`: more process trees by role (the load generator)."""
    inodes = listening_inodes(port)
    children = children_of()
    snap = Snapshot(host_s=host_busy_s())

    def count(role: str, pid: int, tree: bool = True) -> None:
        pids = _subtree(pid, children) if tree else [pid]
        spent = sum(_cpu_s(PROC / str(p) / "stat") for p in pids)
        snap.by_role[role] = snap.by_role.get(role, 0.0) + spent
        snap.pids.setdefault(role, set()).add(pid)

    count("root", root, tree=False)
    direct = children.get(root, [])
    fronts = {c for c in direct if _holds(c, inodes)}
    for child in direct:
        if child in fronts:
            count("front ends", child)
        elif fronts and "resource_tracker" not in _cmdline(child):
            count("engine", child)
            snap.engine_pid = child
            for task in (PROC / str(child) / "task").glob("[0-9]*"):
                snap.engine_threads[int(task.name)] = _cpu_s(task / "stat")
        else:
            count("other", child)
    for role, pid in (others or {}).items():
        count(role, pid)
    return snap


def cores_busy(before: Snapshot, after: Snapshot, wall_s: float) -> dict[str, Any]:
    """Cores each role kept busy between two snapshots; the engine's event loop (its main
    thread: near 1 at saturation) and busiest other thread (the device or a stacking thread);
    the whole host's; and the roles whose processes changed in between (a restart), whose
    figures then mean little."""
    out: dict[str, Any] = {
        role: round((after.by_role.get(role, 0.0) - before.by_role.get(role, 0.0)) / wall_s, 3)
        for role in after.by_role
    }
    spent = {t: s - before.engine_threads.get(t, 0.0) for t, s in after.engine_threads.items()}
    if after.engine_pid in spent:
        out["engine loop thread"] = round(spent.pop(after.engine_pid) / wall_s, 3)
    if spent:
        out["engine busiest other thread"] = round(max(spent.values()) / wall_s, 3)
    out["host"] = round((after.host_s - before.host_s) / wall_s, 3)
    changed = sorted(r for r in after.pids if after.pids[r] != before.pids.get(r))
    if changed:
        out["changed during the window"] = changed
    return out
