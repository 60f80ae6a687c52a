"""`--reuse-port`'s sockets (http/listeners.py): the supervisor holds the port bound with
SO_REUSEPORT, each front end listens on a socket of its own beside it, and the kernel spreads new
connections over the listening ones. Real sockets on loopback, no server processes."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from clipserve.config import ServerConfig
from clipserve.config.loading import load_config
from clipserve.errors import ConfigError, StartupError
from clipserve.http.listeners import beside, bind_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT spreads on Linux")

CONNECTIONS = 64


@contextmanager
def held_port() -> Iterator[socket.socket]:
    held = bind_port("127.0.0.1", 0, "--host/--port", reuse_port=True)
    try:
        yield held
    finally:
        held.close()


def accepted(listener: socket.socket) -> int:
    """Connections waiting in `listener`'s accept queue, accepted and closed."""
    listener.setblocking(False)
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def accepted_all(listeners: list[socket.socket], expected: int) -> list[int]:
    """Each listener's connections, read until `expected` in all have arrived (or 5 s)."""
    counts = [0] * len(listeners)
    deadline = time.monotonic() + 5
    while sum(counts) < expected and time.monotonic() < deadline:
        counts = [c + accepted(sock) for c, sock in zip(counts, listeners, strict=True)]
    return counts


def test_new_connections_spread_over_the_front_ends_sockets() -> None:
    with held_port() as held, ExitStack() as stack:
        port = held.getsockname()[1]
        own = [stack.enter_context(beside(held)) for _ in range(2)]
        for sock in own:
            sock.listen(CONNECTIONS)
        clients = [
            stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
            for _ in range(CONNECTIONS)
        ]
        counts = accepted_all(own, len(clients))
        assert sum(counts) == len(clients)
        # A hash of each connection's addresses: binomial, P(fewer than 12 of 64) ~ 1e-7.
        assert min(counts) >= 12, counts


def test_nothing_else_binds_the_port_while_the_model_loads() -> None:
    """Held and nothing listening yet: a second clipserve (plain or --reuse-port) and another
    server with SO_REUSEADDR are refused; the front ends' sockets are not."""
    with held_port() as held:
        port = held.getsockname()[1]
        for reuse_port in (False, True):
            with pytest.raises(StartupError, match="--host/--port: cannot listen on"):
                bind_port("127.0.0.1", port, "--host/--port", reuse_port=reuse_port)
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError, match="in use"):
                other.bind(("127.0.0.1", port))
        with beside(held) as own:
            assert own.getsockname() == held.getsockname()


def test_the_held_socket_takes_no_connection() -> None:
    with held_port() as held, beside(held) as own:
        port = held.getsockname()[1]
        own.listen(8)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        assert accepted_all([own], 1) == [1]  # bound, not listening: the held socket is no member
        with pytest.raises(StartupError, match="--host/--port: cannot listen on"):
            bind_port("127.0.0.1", port, "--host/--port")


def test_front_ends_bind_the_port_that_port_zero_chose() -> None:
    """`--port 0`: each front end binds the port the supervisor's socket got, not a new one."""
    with held_port() as held, beside(held) as own:
        assert held.getsockname()[1] != 0
        assert own.getsockname()[1] == held.getsockname()[1]


def test_the_option_is_refused_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = {"reuse_port": "true", "workers": "2"}
    assert load_config(flags, {}).http.reuse_port
    assert not ServerConfig().http.reuse_port  # off by default: one shared accept queue
    monkeypatch.setattr("clipserve.config.schema.sys.platform", "darwin")
    with pytest.raises(ConfigError, match="reuse-port"):
        load_config(flags, {})
