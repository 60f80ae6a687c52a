"""Limits at the connection's edge, with raw sockets against real servers: the parser's JSON 400
for bytes after a valid request and for padded or absurd chunk sizes, and the socket budget
under a reconnect storm (a `clipserve` process under a lowered RLIMIT_NOFILE)."""

from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clipserve.http.connections import fd_budget
from clipserve.loadgen.procs import free_port, stop
from tests.helpers import RunningServer, make_config, png_bytes, random_pixels, running, until


@pytest.fixture(scope="module")
def server(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[RunningServer]:
    config = make_config(tiny_config, tiny_checkpoint, backend="fake", linger_timeout_s=2)
    with running(config) as s:
        yield s


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    headers = {k.lower(): v for k, v in response.getheaders()}
    return response.status, headers, response.read()


def read_responses(sock: socket.socket) -> list[tuple[int, dict[str, str], bytes]]:
    """Every response on the connection until the server closes it (a reset fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    answers = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        size = int(headers["content-length"])
        answers.append((int(status_line.split()[1]), headers, rest[:size]))
        data = rest[size:]
    return answers


def error_code(body: bytes) -> str:
    return str(json.loads(body)["error"]["code"])


def test_garbage_after_a_valid_request_gets_its_answer_then_a_json_400(
    server: RunningServer,
) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n")
        answers = read_responses(sock)
    assert [status for status, _, _ in answers] == [200, 400], answers
    _, headers, body = answers[1]
    assert error_code(body) == "invalid_request" and headers["connection"] == "close"
    assert headers["content-type"] == "application/json"


def test_garbage_after_two_pipelined_requests_follows_both_answers(server: RunningServer) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server.port) as sock:
        sock.sendall(request * 2 + b"\x00\x01 nonsense\r\n\r\n")
        answers = read_responses(sock)
    assert [status for status, _, _ in answers] == [200, 200, 400], answers


def chunked_post(size_line: bytes) -> bytes:
    head = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\n"


@pytest.mark.parametrize(
    ("size_line", "split"),
    [
        (b"F" * 19, False),  # past 64 bits: the parser's overflow
        (b"1" + b"0" * 18, True),  # the same, its size line in a later packet
        (b"0" * 2000 + b"1", True),  # leading zeros: a value that fits, a line that never ends
        (b"1;" + b"x" * 4000, True),  # a chunk extension as padding
    ],
)
def test_absurd_chunk_size_lines_get_a_json_400(
    server: RunningServer, size_line: bytes, split: bool
) -> None:
    data = chunked_post(size_line)
    with connect(server.port) as sock:
        if split:  # headers first, so the handler is already reading the body
            at = data.index(b"\r\n\r\n") + 4
            sock.sendall(data[:at])
            time.sleep(0.2)
            data = data[at:]
        sock.sendall(data)
        answers = read_responses(sock)
    assert [status for status, _, _ in answers] == [400], answers
    assert error_code(answers[0][2]) == "invalid_request"


def test_a_body_in_many_small_chunks_is_served(server: RunningServer) -> None:
    body = png_bytes(random_pixels(3, 32))
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7)
    )
    head = chunked_post(b"")[: -len(b"\r\n")]
    with connect(server.port) as sock:
        sock.sendall(head + chunks + b"0\r\n\r\n")
        status, _, answer = read_response(sock)
    assert status == 200, answer
    assert len(json.loads(answer)["embedding"]) > 0


# ---- the socket budget: a clipserve process under a lowered open-file limit ------------------

MAX_CONNECTIONS = 100
NOFILE = 600  # above fd_budget(100), below what unbounded refusals would take


def nofile(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def clipserve_cmd(tiny_config: Path, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "clipserve",
        *("--backend", "fake", "--model", str(tiny_config), "--pretrained", "none"),
        *("--gpus", "cpu", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
        *flags,
    ]


def test_an_open_file_limit_too_low_fails_at_start_naming_both_numbers(tiny_config: Path) -> None:
    cmd = clipserve_cmd(tiny_config, free_port(), "--max-connections", str(MAX_CONNECTIONS))
    done = subprocess.run(
        cmd, preexec_fn=nofile(450), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    need = fd_budget(MAX_CONNECTIONS)
    assert f"open-file limit 450 is below the {need} descriptors" in done.stderr, done.stderr
    assert f"ulimit -n {need}" in done.stderr and "--max-connections to 66" in done.stderr


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_reconnect_storm_stays_within_the_socket_budget_and_probes_never_see_a_reset(
    tiny_config: Path, tmp_path: Path
) -> None:
    port = free_port()
    flags = ("--max-connections", str(MAX_CONNECTIONS), "--header-timeout-s", "60")
    with (tmp_path / "server.log").open("w") as log:
        proc = subprocess.Popen(
            clipserve_cmd(tiny_config, port, *flags),
            preexec_fn=nofile(NOFILE),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    held: list[socket.socket] = []
    try:

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                with connect(port, 2) as sock:
                    sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
                    return read_response(sock)[0] == 200
            except OSError:
                return False

        until(ready, 120, "the server ready", poll_s=0.2)
        baseline = fds(proc.pid)
        # Every served place taken by idle connections: each new one is refused.
        held += [connect(port) for _ in range(MAX_CONNECTIONS)]
        until(lambda: fds(proc.pid) >= baseline + MAX_CONNECTIONS - 2, 10, "connections held")

        stop_at = time.monotonic() + 6
        peak = [0]
        probes: list[object] = []

        def monitor() -> None:
            while time.monotonic() < stop_at:
                peak[0] = max(peak[0], fds(proc.pid))
                time.sleep(0.005)

        def storm() -> None:  # connect, ask, never read; hold each socket a second
            mine: list[tuple[float, socket.socket]] = []
            while time.monotonic() < stop_at:
                try:
                    sock = connect(port, 2)
                    sock.sendall(b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n")  # not a probe
                    mine.append((time.monotonic(), sock))
                except OSError:
                    pass
                # Bounded here too, so a server that never pushes back fails the test, not us.
                while mine and (mine[0][0] < time.monotonic() - 1 or len(mine) > 1000):
                    mine.pop(0)[1].close()
            for _, sock in mine:
                sock.close()

        def probe() -> None:
            while time.monotonic() < stop_at:
                try:
                    with connect(port, 15) as sock:
                        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                        status, headers, _ = read_response(sock)
                        probes.append((status, headers.get("retry-after")))
                except TimeoutError:
                    probes.append("timeout")
                except OSError as e:
                    probes.append(type(e).__name__)
                time.sleep(0.05)

        threads = [threading.Thread(target=f) for f in [monitor, probe, *[storm] * 4]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert proc.poll() is None
        answered = [p for p in probes if isinstance(p, tuple)]
        # Probes past the cap are served (http/probes.py), the storm's requests refused.
        assert [p for p in probes if p != (200, None)] == [], probes
        assert len(answered) >= 2, probes  # others waited in the accept queue
        # Served places, refusals closing and one accept round past the pause, no more.
        room = MAX_CONNECTIONS // 4 if MAX_CONNECTIONS >= 256 else 64
        assert peak[0] <= baseline + MAX_CONNECTIONS + 2 * room, (peak[0], baseline)
        # The storm over, accepting resumes: a probe is answered at once.
        for sock in held:
            sock.close()
        until(lambda: fds(proc.pid) <= baseline + 8, 15, "the sockets closed")
        with connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock)[0] == 200
    finally:
        for sock in held:
            sock.close()
        stop(proc)
