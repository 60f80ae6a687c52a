"""A front end's process under `--workers N`: the same app and uvicorn settings as one process,
its towers the engine's, its listening socket one of the port's SO_REUSEPORT group."""

from __future__ import annotations

import logging
import os
import socket
import threading

from clipserve.config import ServerConfig
from clipserve.engine.child import start_child
from clipserve.engine.messages import ModelCard
from clipserve.http.app import create_app
from clipserve.http.server import build_uvicorn_config, draining_server, ensure_fd_limit

log = logging.getLogger("clipserve.supervisor")
FRONTEND_START_TIMEOUT_S = 60.0


def reuseport_socket(host: str, port: int) -> socket.socket:
    """Bound, not listening: uvicorn listens once the app has started, so the kernel sends a
    (re)starting front end no connection before it can answer them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def frontend_main(
    config: ServerConfig,
    socket_path: str,
    card: ModelCard,
    index: int,
    parent: int,
    together: threading.Barrier | None = None,
    buckets: str | None = None,
) -> None:
    """A front end's entry: the same app and uvicorn settings as one process, its towers
    remote, its listening socket one of the port's SO_REUSEPORT group. `together` (a
    multiprocessing Barrier, at the first start only) holds each front end until all have
    imported what they need, so they start listening together: one that listened alone would
    be handed every early connection, and keep them. `buckets`: the rate limits' table the
    supervisor made for every front end."""
    start_child(config.http.log_level, f"frontend {index}", parent)
    import open_clip  # noqa: F401  the tokenizer's (and torch's) import: the slow part of startup

    if together is not None:
        try:
            together.wait(FRONTEND_START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            log.warning("front end %d: the others did not start in time; starting alone", index)
    app = create_app(config, engine=(socket_path, card), buckets=buckets)
    ensure_fd_limit(config.http.max_connections)
    sock = reuseport_socket(config.http.host, config.http.port)
    server = draining_server(build_uvicorn_config(app, config.http))
    server.run(sockets=[sock])
    logging.shutdown()
    os._exit(0)  # skips interpreter teardown: extension modules' exit-time noise
