"""API keys and rate limits with `--workers 2`, over HTTPS: a quota holds in total across the
front ends (their buckets are one table in shared memory), SIGHUP reaches every front end
through the supervisor, and a bad key file stops the supervisor before the model loads."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from clipserve.loadgen.procs import free_port
from tests.helpers import PNG, marked_png, run_clipserve, self_signed_cert, until

# Multi-process servers started per test (~20 s each here): in `make test-slow`, which CI runs,
# so the default run stays near 10 minutes.
pytestmark = pytest.mark.slow

OLD, NEW = "rotating-key-old", "rotating-key-new"  # the same length: a rewrite keeps the size
SHARED = "shared-key-0001"  # 6 items, then a token per 100 s
METERED = "metered-key-0001"  # 4 items a second, burst 2
KEYS = f"shared:{SHARED}:0.01:6\nmetered:{METERED}:4:2\nrotating:{OLD}\n"


class Server:
    def __init__(
        self, proc: subprocess.Popen[bytes], url: str, tls: ssl.SSLContext, log: Path
    ) -> None:
        self.proc, self.url, self.tls, self.log = proc, url, tls, log

    def post(self, key: str, path: str = "/embed", body: bytes | None = None) -> httpx.Response:
        """One request on a connection of its own (the kernel picks the front end)."""
        headers = {**PNG, "X-API-Key": key}
        content = marked_png(1) if body is None else body
        try:
            return httpx.post(self.url + path, content=content, headers=headers, verify=self.tls)
        except httpx.TransportError as e:  # none is expected: say what the server logged
            tail = self.log.read_text()[-4000:]
            raise AssertionError(f"{e!r}; the server's log ends:\n{tail}") from e

    def burst(self, key: str, n: int) -> list[httpx.Response]:
        """n requests on n connections, 4 at a time: the front ends share one listening
        socket, so requests one after another may all be accepted by whichever is idle."""
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda _: self.post(key), range(n)))

    def until_both(self, key: str, limit: int = 96) -> list[httpx.Response]:
        """Bursts of 8 until both front ends have answered (or `limit` requests)."""
        answers: list[httpx.Response] = []
        while len({front_end(r) for r in answers}) < 2 and len(answers) < limit:
            answers += self.burst(key, 8)
        return answers


def front_end(response: httpx.Response) -> str:
    """Which front end answered: request ids start with a random prefix per process."""
    return response.headers["x-request-id"][:12]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def server(
    tiny_config: Path, keys: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(tmp)
    port = free_port()
    cmd = [sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"]
    cmd += ["--model", str(tiny_config), "--pretrained", "none", "--gpus", "cpu"]
    cmd += ["--api-keys", str(keys), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
    log = tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    tls = ssl.create_default_context(cafile=cert)
    served = Server(proc, f"https://127.0.0.1:{port}", tls, log)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(served.url + "/readyz", verify=served.tls).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(ready, 120, "the --workers 2 server ready over HTTPS", poll_s=0.2)
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_keys_over_https_on_both_front_ends(server: Server) -> None:
    answers = server.until_both("wrong-key-0001")
    assert {r.status_code for r in answers} == {401}
    assert len({front_end(r) for r in answers}) == 2  # both front ends check keys
    http_client = httpx.Client(verify=server.tls)
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key=OLD, max_retries=0, http_client=http_client
    ) as client:
        names = [m.id for m in client.models.list().data]
        assert len(client.embeddings.create(model=names[0], input=["a", "b"]).data) == 2


def test_a_quota_holds_in_total_across_front_ends(server: Server) -> None:
    # 6 items, then nothing for 100 s. Front ends with a bucket each would let 12 through.
    answers = server.burst(SHARED, 16)
    statuses = [r.status_code for r in answers]
    assert statuses.count(200) == 6 and statuses.count(429) == 10, statuses
    refused = [r for r in answers if r.status_code == 429]
    answers += server.until_both(SHARED)  # the bucket is empty: every one of these is refused
    assert len({front_end(r) for r in answers}) == 2, "every request reached one front end"
    assert {r.status_code for r in answers[16:]} == {429}
    assert all(1 <= int(r.headers["retry-after"]) <= 100 for r in refused)


def test_a_rate_holds_in_total_under_load_from_both_front_ends(server: Server) -> None:
    """4 items/s (burst 2) from 4 threads for 3 s: at most burst + rate x time get through
    in all; two front ends with buckets of their own would pass about twice that."""
    done: list[tuple[float, int, str]] = []
    start = time.monotonic()

    def hammer() -> None:
        while time.monotonic() - start < 3.0:
            r = server.post(METERED)
            done.append((time.monotonic(), r.status_code, front_end(r)))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = max(at for at, _, _ in done) - start
    passed = sum(status == 200 for _, status, _ in done)
    assert {status for _, status, _ in done} == {200, 429}
    assert len({front for _, _, front in done}) == 2
    allowed = 2 + 4 * elapsed
    assert passed <= allowed + 1, (passed, elapsed)  # +1: the clocks of the two measurements
    assert passed >= 0.5 * allowed, (passed, elapsed)  # and the bucket does refill


def test_sighup_to_the_supervisor_reloads_every_front_end(server: Server, keys: Path) -> None:
    before = os.stat(keys)
    keys.write_text(KEYS.replace(OLD, NEW))  # in place: the same inode and size
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    server.proc.send_signal(signal.SIGHUP)

    def both_reloaded() -> bool:
        answers = server.until_both(NEW)
        return {r.status_code for r in answers} == {200} and len(
            {front_end(r) for r in answers}
        ) == 2

    until(both_reloaded, 30, "every front end accepting the new key")
    answers = server.until_both(OLD)
    assert {r.status_code for r in answers} == {401}
    assert len({front_end(r) for r in answers}) == 2
    assert server.proc.poll() is None


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_bad_key_file_stops_the_server_before_the_model_loads(
    workers: str, tiny_config: Path, tmp_path: Path
) -> None:
    """One line and exit 2, with nothing logged before it: no model was loaded."""
    bad = tmp_path / "keys.txt"
    bad.write_text("team:key-12345678\nteam:key-12345678:1\n")
    result = run_clipserve(
        "--workers", workers, "--backend", "fake", "--model", str(tiny_config),
        "--pretrained", "none", "--api-keys", str(bad), "--port", str(free_port()),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "keys.txt, line 2" in lines[0], result.stderr
