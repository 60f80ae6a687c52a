"""The Hugging Face Hub, where --pretrained weights come from: checked before open_clip asks it.

Unreachable, huggingface_hub retries every file with backoff (~23 s a file, two files per
tag) before it looks in its cache; a host with no route to the Hub would start 46 s late, or
fail after them. So the Hub's host is tried first, once, for a few seconds: if it cannot be
reached, this process reads the cache only (`HF_HUB_OFFLINE`'s behaviour), and the startup
error says why. Behind a proxy the direct check would mislead, so none is made.
"""

from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
PROXY_VARIABLES = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
)


def route_hub_logs() -> None:
    """open_clip's imports give huggingface_hub's logger a stderr handler of its own: each of
    its records printed twice, once not as JSON under --log-format json. Its records go to
    the root's handler only."""
    hub_logger = logging.getLogger("huggingface_hub")
    for handler in list(hub_logger.handlers):
        hub_logger.removeHandler(handler)
    hub_logger.propagate = True


def offline_if_unreachable() -> str | None:
    """Go offline (the cache only) if the Hub's host cannot be reached: None, or why not."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    why = unreachable(constants.ENDPOINT)
    if why is not None:
        log.warning(
            "%s cannot be reached (%s): reading the local cache only", constants.ENDPOINT, why
        )
        constants.HF_HUB_OFFLINE = True  # read per call (is_offline_mode), as the variable sets it
    return why


def unreachable(endpoint: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None if a TCP connection to the endpoint's host opens within `timeout_s`, else why not."""
    parts = urlsplit(endpoint)
    host = parts.hostname
    if not host:
        return f"no host in {endpoint!r}"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None
