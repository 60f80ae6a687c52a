"""Logging for every process of the server: one format, the process's role in each line."""

from __future__ import annotations

import logging


def configure_logging(level: str, role: str | None = None) -> None:
    """`role` names the process in each line when several serve together (--workers N)."""
    where = f"[{role}] " if role else ""
    logging.basicConfig(
        level=logging.DEBUG if level == "trace" else getattr(logging, level.upper()),
        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s",
    )
