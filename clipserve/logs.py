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
from typing import Any

# The observer's access lines: on at INFO in JSON mode only (their fields are meant for a
# machine; the text format stays what it was, with no line per request).
ACCESS_LOGGER = "clipserve.access"
MAIN_ROLE = "main"  # the process clipserve started as: the server, or --workers N's supervisor


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


def configure_logging(level: str, role: str | None = None, fmt: str = "text") -> None:
    """`role` names the process in each line when several serve together (--workers N);
    `fmt`: "text" or "json" (--log-format)."""
    handler = logging.StreamHandler()
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
