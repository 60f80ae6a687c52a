"""The paths that load balancers, the kubelet and Prometheus ask of every replica, and how to
tell a connection's request for one from its first bytes. They hold no key (http/access.py),
and they are served even past --max-connections (http/guarded.py), where other requests are
refused: a replica that is busy must not look dead to its liveness probe or to its scrape."""

from __future__ import annotations

OPEN_PATHS = frozenset(
    {
        "/healthz",
        "/readyz",
        "/v2/health/live",
        "/v2/health/ready",
        "/health",
        "/v1/health/live",
        "/v1/health/ready",
    }
)
METRICS_PATHS = frozenset({"/metrics", "/v1/metrics"})
PROBE_PATHS = OPEN_PATHS | METRICS_PATHS
MAX_REQUEST_LINE = 8192  # bytes without a line end: not a probe


def asks_probe(head: bytes) -> bool | None:
    """Whether `head`, a connection's first bytes, is a GET or HEAD of a probe path (a query
    allowed); None while its request line is incomplete."""
    start = len(head) - len(head.lstrip(b"\r\n"))  # empty lines before it are allowed
    end = head.find(b"\n", start)
    if end < 0:
        return None if len(head) < MAX_REQUEST_LINE else False
    method, _, rest = head[start:end].rstrip(b"\r").partition(b" ")
    target, _, version = rest.partition(b" ")
    if method not in (b"GET", b"HEAD") or not version.startswith(b"HTTP/1."):
        return False
    return target.partition(b"?")[0].decode("latin-1") in PROBE_PATHS
