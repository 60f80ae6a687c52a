"""Where servers listen: the HTTP port bound before the model loads (so a taken port fails at
once), sockets beside it for front ends and gRPC, and the TLS pair checked up front."""

from __future__ import annotations

import socket
import ssl

from clipserve.config import HttpConfig
from clipserve.errors import StartupError


def bind_port(host: str, port: int, option: str, *, reuse_port: bool = False) -> socket.socket:
    """The port bound, not listening, or StartupError naming `option` when anything holds it.
    `reuse_port`: then rebound with SO_REUSEPORT alone, so the front ends' gRPC servers (which
    cannot serve on an inherited socket) and, with --reuse-port, their HTTP listeners bind
    beside it, while a second server cannot (without SO_REUSEADDR on the held socket, neither
    another SO_REUSEADDR server nor a second clipserve binds the port while nothing listens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:  # without SO_REUSEPORT: a second clipserve on the port must not pass
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if reuse_port:
            address = sock.getsockname()  # the port bound, also where --port 0 chose one
            sock.close()
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
    except OSError as e:
        sock.close()
        raise StartupError(f"{option}: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


def beside(held: socket.socket) -> socket.socket:
    """A socket of this process's own on `held`'s address (bound with SO_REUSEPORT): with
    `--reuse-port` each front end listens on one, and the kernel spreads new connections over
    the listening ones by a hash of each connection's addresses."""
    sock = socket.socket(held.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(held.getsockname())  # all of it: an IPv6 address's scope too
    except OSError:
        sock.close()
        raise
    return sock


def check_tls(config: HttpConfig) -> None:
    """Load the certificate and key once, so a bad pair is a one-line StartupError rather than
    uvicorn's traceback once the model has loaded (or a front end that never starts)."""
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise StartupError(
            f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile {config.ssl_keyfile}: {e}"
        ) from None
