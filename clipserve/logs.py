"""Logging for every process of the server: one format, the process's role in each line.

`--log-format text` (the default) writes a line of text per event. `--log-format json` writes
one JSON object per line (time, level, logger, role, message, exception), uvicorn's own lines
included, and an access line per request from the `clipserve.access` logger (http/observer.py),
which is silent in text mode.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from typing import Any

# The observer's access lines: on at INFO in JSON mode only (their fields are meant for a
# machine; the text format stays what it was, with no line per request).
ACCESS_LOGGER = "clipserve.access"
MAIN_ROLE = "main"  # the process clipserve started as: the server, or --workers N's supervisor
# Lines any client can make the server write, one per bad request: at most one of each per
# interval, the next one saying how many were left out. (logger, message template)
CLIENT_NOISE = {
    ("uvicorn.error", "Invalid HTTP request received."),
    ("uvicorn.error", "Exceeded concurrency limit."),
}
# A malformed multipart body is refused with a 400; the parser's own warnings (python-multipart
# logs from this one module) say no more.
MULTIPART_LOGGER = "python_multipart.multipart"
# The loggers those records are made on: a logger's filters see its own records, whatever
# handlers uvicorn's logging config installs.
NOISY = ("uvicorn.error", MULTIPART_LOGGER)
NOISE_INTERVAL_S = 10.0


ACCESS = logging.getLogger(ACCESS_LOGGER)


def log_access(
    request_id: str,
    method: str,
    route: str,
    path: str,
    status: int,
    elapsed: float,
    items: int | None,
    client: str | None,
    key: str | None,
) -> None:
    """One access line, its fields as docs/operations.md lists them, for HTTP and gRPC alike."""
    fields = {
        "request_id": request_id,
        "method": method,
        "route": route,
        "path": path,
        "status": status,
        "duration_ms": round(elapsed * 1000, 3),
        "items": items,
        "client": client,
        "key": key,
    }
    ACCESS.info("%s %s %d", method, path, status, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per record. A record's `fields` (a dict, given as `extra={"fields":
    ...}`) are added as they are: the access lines' request id, status, duration and so on."""

    def __init__(self, role: str | None = None) -> None:
        super().__init__()
        self.role = role or MAIN_ROLE

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        entry: dict[str, Any] = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "role": self.role,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


class ClientNoise(logging.Filter):
    """At most one line per CLIENT_NOISE message (and per noisy logger) per NOISE_INTERVAL_S;
    the next line let through counts those held back. Other records pass untouched."""

    def __init__(self, interval_s: float = NOISE_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = self._key(record)
        if key is None:
            return True
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} more like it not logged)"
            record.args = None
        return True

    @staticmethod
    def _key(record: logging.LogRecord) -> tuple[str, str] | None:
        if record.name == MULTIPART_LOGGER:
            return record.name, ""
        key = (record.name, str(record.msg))
        if key in CLIENT_NOISE:
            return key
        return None


def configure_logging(level: str, role: str | None = None, fmt: str = "text") -> None:
    """`role` names the process in each line when several serve together (--workers N);
    `fmt`: "text" or "json" (--log-format)."""
    handler = logging.StreamHandler()
    noise = ClientNoise()
    for name in NOISY:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, ClientNoise)]:
            logger.removeFilter(old)  # configured again (tests, a child process)
        logger.addFilter(noise)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        where = f"[{role}] " if role else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s")
        )
    logging.basicConfig(
        level=logging.DEBUG if level == "trace" else getattr(logging, level.upper()),
        handlers=[handler],
    )
    # Python's warnings become records too, so that JSON mode writes nothing but JSON.
    logging.captureWarnings(fmt == "json")
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET if fmt == "json" else logging.WARNING)
