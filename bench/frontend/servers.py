"""The servers under test, as process trees: started pinned (under py-spy when profiled), their
processes told apart by role, their CPU time read, and this process pinned beside them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil  # type: ignore[import-untyped]

from bench.common import REPO, say
from clipserve.loadgen.payloads import Request
from clipserve.loadgen.procs import free_port, knows, pin, wait_ready


@dataclass
class Server:
    name: str
    argv: list[str]  # after `python`, without --host/--port
    cwd: Path = REPO
    env: dict[str, str] | None = None
    clipserve: bool = True
    front_ends: int = 1
    python: str = sys.executable  # another interpreter for another server's environment
    ready_path: str = "/readyz"  # answers 200 once the server serves
    # The requests it takes for each payload kind, where not clipserve's own (another API);
    # kinds missing here are not sent to it.
    requests: dict[str, list[Request]] | None = None


@dataclass
class Running:
    server: Server
    proc: subprocess.Popen[bytes]  # py-spy when profiled, else the server itself
    root: psutil.Process  # the server's first process
    url: str


def clipserve(name: str, flags: Sequence[str], tree: Path | None = None) -> Server:
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    n = int(flags[flags.index("--workers") + 1]) if "--workers" in flags else 1
    argv = ["-m", "clipserve", *flags, "--log-level", "warning"]
    if knows(tree, "cache_mb") and "--cache-mb" not in flags:
        # One payload sent over and over would measure the embedding cache's hits.
        argv += ["--cache-mb", "0"]
    if knows(tree, "grpc_port") and "--grpc-port" not in flags:
        # gRPC stays on, as served, but on a port of its own: servers run side by side.
        argv += ["--grpc-port", str(free_port())]
    return Server(name, argv, tree or REPO, env, front_ends=n)


def floor() -> Server:
    argv = ["-m", "uvicorn", "bench.frontend.floor:app", "--http", "httptools"]
    return Server("floor", [*argv, "--log-level", "warning", "--no-access-log"], clipserve=False)


def floor_kept() -> Server:
    """The floor with clipserve's heap settings (http/heap.py) given as glibc's variables: a
    request body then lands on pages kept from the last, not on new ones. Without them the
    floor's glibc sometimes maps and faults in every body's pages (34 faults a 150 KB request,
    about twice the CPU), so the floor alone moves from round to round."""
    from clipserve.config import ServerConfig
    from clipserve.http.heap import MMAP_THRESHOLD

    kept = {
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(ServerConfig().limits.max_body_bytes_in_flight),
    }
    return dataclasses.replace(floor(), name="floor-kept", env={**os.environ, **kept})


def bare() -> Server:
    """The floor's answer from a bare httptools protocol (bench/frontend/bare.py)."""
    argv = ["-m", "bench.frontend.bare"]
    return Server("bare", argv, clipserve=False)


def direct(model: Path) -> Server:
    """clipserve's /embed under a bare protocol (bench/frontend/direct.py)."""
    argv = ["-m", "bench.frontend.direct", *fake_flags(model), "--cache-mb", "0"]
    return Server("direct", [*argv, "--log-level", "warning"], clipserve=False)


def fake_flags(model: Path, *options: str) -> list[str]:
    flags = ["--backend", "fake", "--pretrained", "none", "--model", str(model), "--gpus", "cpu"]
    for o in ("compute=0", *options):
        flags += ["--backend-option", o]
    return flags


def py_spy(profile: Path) -> list[str]:
    """`py-spy record` of a command and its descendants, raw stacks per thread into `profile`."""
    spy = str(Path(sys.executable).with_name("py-spy"))
    options = ["--format", "raw", "--subprocesses", "--threads", "--rate", "200"]
    return [spy, "record", *options, "-o", str(profile), "--"]


@contextlib.contextmanager
def start(
    s: Server, cpus: set[int] | None, profile: Path | None = None, startup_s: float = 300
) -> Iterator[Running]:
    """The server on a free port, pinned to `cpus`; under `py-spy record` with `profile` (py-spy
    may only trace its own descendants here, so it starts the server)."""
    port = free_port()
    cmd = [s.python, *s.argv, "--host", "127.0.0.1", "--port", str(port)]
    if profile is not None:
        cmd = py_spy(profile) + cmd
    stdout = subprocess.DEVNULL if profile else None
    proc = subprocess.Popen(cmd, cwd=s.cwd, env=s.env, preexec_fn=pin(cpus), stdout=stdout)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, startup_s, s.name, s.ready_path)
        root = psutil.Process(proc.pid)
        if profile is not None:
            root = root.children()[0]
        wait_front_ends(root, s.front_ends, port)
        yield Running(s, proc, root, url)
    finally:
        _stop(proc, profile is not None)


def pytriton(python: str, tensors: list[Request]) -> Server:
    """Triton's front end and dynamic batcher (PyTriton, `bench/frontend/pytriton_model.py`,
    a fixed answer) in the interpreter `python` has (`make pytriton-env`). Its tensor requests:
    KServe v2 binary infer of the same uint8 crops, the answer asked in JSON as clipserve's
    /embed gives it."""
    argv = [str(REPO / "bench" / "frontend" / "pytriton_model.py")]
    own = [_kserve_uint8(r) for r in tensors]
    return Server(
        "pytriton",
        argv,
        clipserve=False,
        python=python,
        ready_path="/v2/models/clip/ready",
        requests={"tensor": own},
    )


def _kserve_uint8(tensor: Request) -> Request:
    shape = [int(x) for x in tensor.headers["X-Tensor-Shape"].split(",")]
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": shape,
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(tensor.body)},
                }
            ],
            "outputs": [{"name": "embedding", "parameters": {"binary_data": False}}],
        }
    ).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return Request("/v2/models/clip/infer", header + tensor.body, headers, tensor.items)


def _stop(proc: subprocess.Popen[bytes], profiled: bool) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(psutil.Error, IndexError):
        # SIGTERM to the server, not py-spy: py-spy writes its profile once the server is gone.
        target = psutil.Process(proc.pid).children()[0].pid if profiled else proc.pid
        os.kill(target, signal.SIGTERM)
    try:
        proc.wait(150)  # py-spy writes its profile only once the whole tree is gone
    except subprocess.TimeoutExpired:
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.kill()
        proc.wait()


def start_all(
    stack: contextlib.ExitStack, servers: Sequence[Server], cpus: set[int] | None
) -> tuple[list[Running], dict[str, str]]:
    """Every server that starts; the reason for each that does not (say, --workers 2 before the
    engine exists) instead of ending the run."""
    up, skipped = [], {}
    for s in servers:
        try:
            up.append(stack.enter_context(start(s, cpus)))
        except RuntimeError as e:
            skipped[s.name] = str(e)
            say(f"skipped {s.name}: {e}")
    return up, skipped


def _listens(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp"))
    return False


def role(p: psutil.Process, root: psutil.Process) -> str:
    """What a server process is. With --workers N > 1 the root is the supervisor (it holds the
    shared listening socket too), the front ends are the children that hold it, and the one
    other spawned child is the engine."""
    with contextlib.suppress(psutil.Error):
        if p.pid == root.pid:
            return "supervisor" if root.children() else "server"
        if "resource_tracker" in " ".join(p.cmdline()):
            return "resource tracker"
        if p.name().startswith(("tritonserver", "triton_python")):  # PyTriton's processes
            return p.name()
    return "front end" if _listens(p) else "engine"


def tree_cpu(root: psutil.Process) -> dict[int, tuple[float, str]]:
    """CPU-seconds (user + system, all threads) of the process and every descendant now."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = (t.user + t.system, f"{role(p, root)} {p.pid}")
    return out


def tree_faults(root: psutil.Process) -> int:
    """Minor page faults of the process and every descendant so far (Linux; 0 elsewhere): a
    body that lands on new pages faults once per 4 KiB."""
    total = 0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error, OSError, IndexError, ValueError):
            stat = Path(f"/proc/{p.pid}/stat").read_text()
            total += int(stat.rpartition(")")[2].split()[7])  # minflt, after the name
    return total


def wait_front_ends(root: psutil.Process, n: int, port: int, timeout_s: float = 120) -> None:
    """/readyz answers once one front end is up; load waits until all `n` accept. Every front
    end holds the shared listening socket from its start but accepts only once its app has
    started, so this opens connections until `n` distinct processes have accepted one."""
    deadline = time.monotonic() + timeout_s
    owners: set[int] = set()
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 5) as c:
            owner = _accepted_by(root, c.getsockname()[1], port, deadline)
            if owner is not None:
                owners.add(owner)
        if len(owners) >= n:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{n} front ends not accepting after {timeout_s:g} s")


def _accepted_by(root: psutil.Process, client_port: int, port: int, until: float) -> int | None:
    """The pid of the process holding the server side of the connection from `client_port`."""
    stop = min(until, time.monotonic() + 2)  # accepted, but maybe not yet by a process
    while time.monotonic() < stop:
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                for c in p.net_connections("tcp"):
                    if c.raddr and c.raddr.port == client_port and c.laddr.port == port:
                        return int(p.pid)
        time.sleep(0.01)
    return None


@contextlib.contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """This process (the load generator, and wrk as its child) on `cpus` for the block."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def split_cpus(client_cores: int) -> tuple[set[int] | None, set[int] | None]:
    """Server on the first cores, the load generator on the last `client_cores`."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) <= client_cores:
        return None, None
    return set(cores[:-client_cores]), set(cores[-client_cores:])


def pinning(server_cpus: set[int] | None, client_cpus: set[int] | None) -> dict[str, list[int]]:
    """The cores of each side, as the results record them."""
    return {"server_cpus": sorted(server_cpus or []), "client_cpus": sorted(client_cpus or [])}
