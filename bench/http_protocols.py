"""What the connection limits cost per request: uvicorn's HTTP protocols side by side.

Feeds GET /healthz through each protocol on an in-memory transport (no sockets, one thread)
and reports the CPU time per request (thread_time, so other processes on a shared machine
count less), in interleaved rounds with the order rotated, for a trivial ASGI app and for
clipserve's app (fake backend). Variants: `guarded` (clipserve's protocol), `httptools`
(uvicorn's, which it extends) and `h11` (uvicorn's other implementation, the one with a
header cap setting). Writes bench/results/http_protocols.json.

    python -m bench.http_protocols --rounds 11 --requests 4000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from uvicorn.server import ServerState

from bench.common import add_model_flags, machine, model_flags, rotated, spread, utc_now
from clipserve.config import load_config
from clipserve.http.app import create_app
from clipserve.http.server import build_uvicorn_config

REQUEST = (
    b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n"
)
VARIANTS = ("guarded", "httptools", "h11")


class NullTransport(asyncio.Transport):
    """Drops what is written; a close is recorded (a keep-alive request must never close)."""

    closed = False

    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def trivial(scope: Any, receive: Any, send: Any) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"15")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b'{"status":"ok"}'})


async def cpu_us_per_request(
    variant: str, app: Any, app_state: dict[str, Any], http: Any, n: int
) -> float:
    overrides = {} if variant == "guarded" else {"http": variant}
    config = build_uvicorn_config(app, http, **overrides)
    config.load()
    state = ServerState()
    protocol = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=state, app_state=app_state, _loop=asyncio.get_running_loop()
    )
    transport = NullTransport()
    protocol.connection_made(transport)
    feed = _feeder(protocol)
    t0 = time.thread_time()
    for _ in range(n):
        feed(REQUEST)
        await asyncio.sleep(0)  # the request's task runs to completion
    elapsed = time.thread_time() - t0
    assert state.total_requests == n and not transport.closed, variant
    protocol.connection_lost(None)
    return elapsed / n * 1e6


def _feeder(protocol: Any) -> Callable[[bytes], None]:
    """How a transport hands the protocol what it read: into the protocol's own buffer where
    it has one (clipserve's, http/buffered.py), else as bytes."""
    if not isinstance(protocol, asyncio.BufferedProtocol):
        return cast(Callable[[bytes], None], protocol.data_received)

    def feed(data: bytes) -> None:
        while data:
            view = memoryview(protocol.get_buffer(len(data)))
            n = min(len(view), len(data))
            view[:n] = data[:n]
            protocol.buffer_updated(n)
            data = data[n:]

    return feed


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config({**model_flags(args), "backend": "fake", "log_level": "warning"}, {})
    app = create_app(config)
    results: dict[str, dict[str, list[float]]] = {}
    async with app.router.lifespan_context(app) as app_state:
        apps = {"trivial": (trivial, {}), "clipserve": (app, dict(app_state or {}))}
        for r in range(args.rounds):
            for name, (asgi, state) in apps.items():
                for variant in rotated(VARIANTS, r):
                    us = await cpu_us_per_request(variant, asgi, state, config.http, args.requests)
                    results.setdefault(name, {}).setdefault(variant, []).append(us)
    report: dict[str, Any] = {}
    for name, by_variant in results.items():
        base = by_variant["httptools"]
        report[name] = {
            "cpu_us_per_request": {v: spread(us, 2) for v, us in by_variant.items()},
            "paired_difference_us_vs_httptools": {
                v: spread([a - b for a, b in zip(us, base, strict=True)], 2)
                for v, us in by_variant.items()
                if v != "httptools"
            },
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_flags(parser)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--requests", type=int, default=4000, help="per variant per round")
    parser.add_argument("--out", default="bench/results/http_protocols.json")
    args = parser.parse_args()
    report = {
        "benchmark": "http_protocols",
        "machine": machine(),
        "date": utc_now(),
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "results": asyncio.run(run(args)),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["results"], indent=2))


if __name__ == "__main__":
    main()
