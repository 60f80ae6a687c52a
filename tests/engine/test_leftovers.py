"""What `--workers N` leaves behind: a supervisor killed outright leaves its temp dir and its
/dev/shm files, which the next supervisor removes (never a live one's); and restarted children
leave metrics files, which are merged so the directory stays bounded and counters keep counting.
Real processes, signals and files."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from clipserve.engine.slots import shm_dir
from clipserve.loadgen.procs import free_port
from tests.helpers import until

# Multi-process servers started per test (~20 s each here): in `make test-slow`, which CI runs,
# so the default run stays near 10 minutes.
pytestmark = pytest.mark.slow


class Server:
    def __init__(self, tiny_config: Path, tmpdir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"]
        cmd += ["--model", str(tiny_config), "--pretrained", "none", "--gpus", "cpu"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "info"]
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env["TMPDIR"] = str(tmpdir)  # its temp dir where the test can see all of them
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                ok = httpx.get(self.url + "/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
            return ok and len(self.front_ends()) == 2

        until(ready, 120, "the --workers 2 server ready", poll_s=0.2)

    def front_ends(self) -> list[int]:
        found = []
        for child in psutil.Process(self.pid).children():
            try:
                if any(c.laddr.port == self.port for c in child.net_connections("tcp")):
                    found.append(child.pid)
            except psutil.NoSuchProcess:
                continue
        return found

    def files(self, tmpdir: Path) -> list[Path]:
        """Its entries in the temp dir and the shared-memory dir: named after its pid."""
        prefix = f"clipserve-{self.pid}-*"
        return sorted({*tmpdir.glob(prefix), *shm_dir().glob(prefix)})

    def named_semaphores(self) -> list[str]:
        """The POSIX named semaphores its processes have mapped whose names still exist (the
        start barrier's: multiprocessing's /dev/shm/sem.mp-*). Mapped but unlinked ones read
        "(deleted)" in /proc/PID/maps and are left out: they vanish with the last process."""
        found: set[str] = set()
        for proc in [psutil.Process(self.pid), *psutil.Process(self.pid).children()]:
            try:
                maps = Path(f"/proc/{proc.pid}/maps").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            found.update(
                line.split()[-1]
                for line in maps.splitlines()
                if "/sem." in line and not line.endswith("(deleted)")
            )
        return sorted(found)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_tree(self.pid)
        self.proc.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL to a process and its children at once: nobody cleans up."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in procs:
        proc.kill()
    psutil.wait_procs(procs, timeout=30)


@contextmanager
def servers(tiny_config: Path, tmpdir: Path, n: int) -> Iterator[list[Server]]:
    with ExitStack() as stack:
        started = []
        for i in range(n):
            server = Server(tiny_config, tmpdir, tmpdir.parent / f"server{i}.log")
            stack.callback(server.stop)
            started.append(server)
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(Server.wait_ready, started))
        yield started


def test_a_killed_supervisors_files_are_removed_by_the_next_never_a_live_ones(
    tiny_config: Path, tmp_path: Path
) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    with servers(tiny_config, tmpdir, 2) as (killed, live):
        # The front ends' start barrier is unlinked once both have it open: a supervisor killed
        # with its resource tracker (as here) would otherwise leave its semaphores in /dev/shm.
        until(lambda: killed.named_semaphores() == [], 10, "the start barrier unlinked")
        left = killed.files(tmpdir)
        kill_tree(killed.pid)
        # What it left: its temp dir (socket, metrics), lock file and slot files.
        assert any(p.parent == tmpdir and p.is_dir() for p in left), left
        assert any(p.name.endswith("-lock") for p in left), left
        assert any(re.search(r"-\d+\.\d+$", p.name) for p in left), left
        assert set(left) <= set(killed.files(tmpdir))
        live_files = live.files(tmpdir)
        with servers(tiny_config, tmpdir, 1) as (nxt,):
            assert killed.files(tmpdir) == []
            assert set(live_files) <= set(live.files(tmpdir))  # the live one's untouched
            assert nxt.files(tmpdir)  # and the new one's own, of course
            assert httpx.get(live.url + "/readyz", timeout=10).status_code == 200
            assert f"{killed.pid}: {len(left)}" in nxt.log.read_text()
        assert nxt.proc.returncode == 0 and nxt.files(tmpdir) == []
    assert live.proc.returncode == 0 and live.files(tmpdir) == []


def _requests_total(server: Server) -> float:
    """The /embed/text 200s counted so far, every process's (scraped from some front end)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    pattern = r'^clipserve_requests_total\{route="/embed/text",status="200"\} ([0-9.e+]+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def _counted_at_least(server: Server, n: int) -> bool:
    return _requests_total(server) >= n


def _kill_front_end(server: Server, victim: int, metrics: Path) -> None:
    os.kill(victim, signal.SIGKILL)
    until(lambda: victim not in server.front_ends(), 30, "the front end gone")
    server.wait_ready()
    until(lambda: not list(metrics.glob(f"*_{victim}.db")), 10, "its files merged")


def test_restarted_front_ends_metrics_are_merged_and_counters_never_drop(
    tiny_config: Path, tmp_path: Path
) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    with servers(tiny_config, tmpdir, 1) as (server,):
        (metrics,) = tmpdir.glob(f"clipserve-{server.pid}-*/metrics")
        sent = 0
        for restart in range(4):
            for _ in range(6):
                r = httpx.post(server.url + "/embed/text", json={"texts": ["a"]}, timeout=30)
                assert r.status_code == 200, r.text
                sent += 1
            # Counted once answered, and written once per loop iteration: the sum is awaited,
            # and must then be exact.
            until(functools.partial(_counted_at_least, server, sent), 5, "the counts")
            assert _requests_total(server) == sent
            _kill_front_end(server, server.front_ends()[restart % 2], metrics)
            # Every request counted once: none lost with the dead front end, none twice.
            assert _requests_total(server) == sent
        names = sorted(p.name for p in metrics.glob("*.db"))
        assert "counter_merged.db" in names and "histogram_merged.db" in names, names
        # One set of files per live process, plus one merged file per metric kind: none left
        # per restart. (Counting files would race: a process writes a kind's file only once
        # it has touched such a metric, and the kernel spreads the requests at random.)
        shared = [n for n in names if not re.search(r"_\d+\.db$", n)]
        assert all(re.fullmatch(r"[a-z_]+_(merged|supervisor)\.db", n) for n in shared), names
        pids = {int(m.group(1)) for n in names if (m := re.search(r"_(\d+)\.db$", n))}
        assert pids <= {
            *server.front_ends(),
            *(c.pid for c in psutil.Process(server.pid).children()),
        }
