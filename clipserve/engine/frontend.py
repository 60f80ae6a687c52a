"""A front end's process under `--workers N`: the same app and uvicorn settings as one process,
its towers the engine's, its listening socket the one the supervisor bound for all of them."""

from __future__ import annotations

import logging
import os
import socket
import threading

from clipserve.config import ServerConfig
from clipserve.engine.child import start_child
from clipserve.engine.messages import ModelCard
from clipserve.http.app import create_app
from clipserve.http.connections import ensure_fd_limit
from clipserve.http.heap import keep_body_pages
from clipserve.http.listeners import beside
from clipserve.http.observer import request_tracing
from clipserve.http.server import build_uvicorn_config, draining_server

log = logging.getLogger("clipserve.supervisor")
FRONTEND_START_TIMEOUT_S = 60.0


def frontend_main(
    config: ServerConfig,
    socket_path: str,
    card: ModelCard,
    index: int,
    parent: int,
    listener: socket.socket,
    together: threading.Barrier | None = None,
    buckets: str | None = None,
) -> None:
    """A front end's entry: the same app and uvicorn settings as one process, its towers
    remote. `listener`: the port's one socket, bound by the supervisor and inherited by every
    front end (one accept queue, which outlives any one front end); uvicorn listens on it and
    accepts only once the app has started, so until then its clients wait in the queue for
    another front end. `together` (a multiprocessing Barrier, at the first start only) holds
    each front end until all have imported what they need, so they start accepting together:
    one that accepted alone would take every early connection, and keep-alive clients would
    stay with it. With `--reuse-port` it listens on a socket of its own beside `listener`
    instead. `buckets`: the rate limits' table the supervisor made for every front end."""
    start_child(config.http.log_level, f"frontend {index}", parent, config.http.log_format)
    import open_clip  # noqa: F401  the tokenizer's (and torch's) import: the slow part of startup

    if together is not None:
        try:
            together.wait(FRONTEND_START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            log.warning(
                "front end %d: another did not reach the start (slow, or exited); starting alone",
                index,
            )
    app = create_app(config, engine=(socket_path, card), buckets=buckets, front_end=(parent, index))
    ensure_fd_limit(config.http.max_connections)
    keep_body_pages(config.limits.max_body_bytes_in_flight, config.http.workers)
    if config.http.reuse_port:
        try:
            own = beside(listener)
        except OSError as e:  # one line, not a traceback; the supervisor restarts it
            log.error("front end %d: --reuse-port: cannot bind beside the port: %s", index, e)
            os._exit(1)
        listener.close()
        listener = own
    server = draining_server(build_uvicorn_config(app, config.http), config.http.shutdown_delay_s)
    server.run(sockets=[listener])
    tracing = request_tracing(config.http.otel_endpoint)
    if tracing is not None:  # os._exit skips the SDK's exit-time flush: the last spans go now
        tracing.close()
    logging.shutdown()
    os._exit(0)  # skips interpreter teardown: extension modules' exit-time noise
