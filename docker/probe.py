"""docker/test.sh's client for a container on --network host: the standard library only, so it
runs on the host's python3 whatever is installed there.

  probe.py ready PORT CONTAINER [DOCKER]   until /readyz answers 200 and Docker reports healthy
  probe.py check PORT JPEG                 /embed, /v1/embeddings and /metrics
  probe.py drain PORT JPEG CONTAINER [DOCKER]   SIGTERM under load: every request answered, exit 0

Each prints one JSON object; a failed check exits 1.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

HOST = "127.0.0.1"


def request(
    port: int, method: str, path: str, body: bytes | None = None, ctype: str = ""
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": ctype} if ctype else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def health(docker: str, container: str) -> str:
    out = subprocess.run(
        [docker, "inspect", "-f", "{{.State.Status}} {{.State.Health.Status}}", container],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if out and out[0] != "running":
        raise SystemExit(f"probe: the container is {out[0]}, not running")
    return out[1] if len(out) > 1 else "none"


def ready(port: int, container: str, docker: str, limit_s: float = 600) -> dict[str, Any]:
    """Seconds from now (just after `docker run`) to /readyz 200, and to Docker's 'healthy'
    (its HEALTHCHECK runs every 10 s, so that one comes up to 10 s later)."""
    start = time.monotonic()
    ready_s = None
    while time.monotonic() - start < limit_s:
        if ready_s is None:
            try:
                if request(port, "GET", "/readyz")[0] == 200:
                    ready_s = round(time.monotonic() - start, 2)
            except OSError:
                pass
        if health(docker, container) == "healthy":
            return {"ready_s": ready_s, "healthy_s": round(time.monotonic() - start, 2)}
        time.sleep(0.25)
    raise SystemExit(f"probe: not healthy after {limit_s:g} s (readyz 200 after {ready_s} s)")


def unit_norm(vector: list[float]) -> bool:
    return abs(math.sqrt(sum(x * x for x in vector)) - 1) < 1e-3


def check(port: int, jpeg: bytes) -> dict[str, Any]:
    status, body = request(port, "POST", "/embed", jpeg, "image/jpeg")
    assert status == 200, (status, body[:300])
    image = json.loads(body)
    assert len(image["embedding"]) == image["dim"] and unit_norm(image["embedding"]), image
    status, body = request(port, "GET", "/v1/models")
    assert status == 200, (status, body[:300])
    model = json.loads(body)["data"][0]["id"]
    text_request = json.dumps({"model": model, "input": "a photo of a cat"}).encode()
    status, body = request(port, "POST", "/v1/embeddings", text_request, "application/json")
    assert status == 200, (status, body[:300])
    text = json.loads(body)["data"][0]["embedding"]
    assert len(text) == image["dim"] and unit_norm(text), body[:300]
    status, body = request(port, "GET", "/metrics")
    assert status == 200, status
    wanted = {
        'clipserve_requests_total{route="/embed",status="200"}': 1.0,
        'clipserve_requests_total{route="/v1/embeddings",status="200"}': 1.0,
        "clipserve_items_total": 1.0,
        "clipserve_text_items_total": 1.0,
    }
    samples = {}
    for line in body.decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            samples[name] = float(value)
    assert all(samples.get(k, 0) >= v for k, v in wanted.items()), samples
    return {"model": model, "dim": image["dim"], "metrics": samples}


def host_pid(docker: str, container: str) -> int | None:
    """The container's first process where this host runs it, to signal it straight from here:
    `docker kill` takes ~0.5 s, longer than a request, so nothing would be in flight when its
    signal lands."""
    pid = subprocess.run(
        [docker, "inspect", "-f", "{{.State.Pid}}", container],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return int(pid) if b"clipserve" in f.read() else None
    except OSError:
        return None


def drain(
    port: int, jpeg: bytes, container: str, docker: str, threads: int = 8, warm: int = 40
) -> dict[str, Any]:
    """Closed-loop load from `threads` clients (a new connection per request, so a refused
    connect means the listener is closed and the request was never sent), SIGTERM once `warm`
    requests were answered, then each client stops at its first refused connect. Any other
    outcome (a reset or an empty reply to a request that was sent) is a lost request."""
    records: list[tuple[float, float, str]] = []
    lock = threading.Lock()
    done = threading.Event()
    give_up = time.monotonic() + 120

    def client() -> None:
        while time.monotonic() < give_up:
            start = time.monotonic()
            conn = http.client.HTTPConnection(HOST, port, timeout=60)
            try:
                conn.connect()
            except ConnectionRefusedError:
                with lock:
                    records.append((start, time.monotonic(), "refused"))
                return
            try:
                conn.request("POST", "/embed", body=jpeg, headers={"Content-Type": "image/jpeg"})
                response = conn.getresponse()
                response.read()
                outcome = str(response.status)
            except (OSError, http.client.HTTPException) as e:
                outcome = "lost:" + type(e).__name__
            finally:
                conn.close()
            with lock:
                records.append((start, time.monotonic(), outcome))
                if sum(r[2] == "200" for r in records) >= warm:
                    done.set()

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for w in workers:
        w.start()
    if not done.wait(120):
        raise SystemExit("probe: the load never reached its warm-up count")
    pid = host_pid(docker, container)
    kill_start = time.monotonic()
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
    else:
        subprocess.run([docker, "kill", "-s", "TERM", container], check=True, capture_output=True)
    killed = time.monotonic()
    for w in workers:
        w.join()
    wait = subprocess.run([docker, "wait", container], check=True, capture_output=True, text=True)
    exit_code = int(wait.stdout.strip())
    exited_s = time.monotonic() - killed
    outcomes: dict[str, int] = {}
    for _, _, outcome in records:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    lost = sum(n for k, n in outcomes.items() if k.startswith("lost"))
    problems = []
    if exit_code != 0:
        problems.append(f"exit code {exit_code}")
    if lost:
        problems.append(f"{lost} requests sent and never answered (connection reset or closed)")
    if any(o == "refused" and s < kill_start for s, _, o in records):
        problems.append("connections refused before SIGTERM")
    if set(outcomes) - {"200", "503", "refused"} - {k for k in outcomes if k.startswith("lost")}:
        problems.append("answers other than 200 and 503")
    result = {
        "clients": threads,
        "requests": len(records),
        "outcomes": outcomes,
        # Sent before the signal, answered after it: the drain finished them.
        "in_flight_at_sigterm_answered": sum(
            s < kill_start and e > killed and o == "200" for s, e, o in records
        ),
        "last_answer_after_sigterm_s": round(
            max((e - killed for s, e, o in records if o[0].isdigit()), default=0.0), 3
        ),
        "signal_via": "docker kill" if pid is None else "kill(2) from the host",
        "exit_code": exit_code,
        "sigterm_to_exit_s": round(exited_s, 2),
        "problems": problems,
    }
    if problems:
        print(json.dumps(result))
        raise SystemExit(1)
    return result


def main(argv: list[str]) -> None:
    command, port = argv[0], int(argv[1])
    if command == "ready":
        result = ready(port, argv[2], argv[3] if len(argv) > 3 else "docker")
    elif command == "check":
        with open(argv[2], "rb") as f:
            result = check(port, f.read())
    elif command == "drain":
        with open(argv[2], "rb") as f:
            jpeg = f.read()
        result = drain(port, jpeg, argv[3], argv[4] if len(argv) > 4 else "docker")
    else:
        raise SystemExit(__doc__)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
