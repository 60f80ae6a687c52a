"""Media types: parsing Content-Type and negotiating Accept."""

from __future__ import annotations

from clipserve.errors import NotAcceptable

JSON = "application/json"
# Accept is parsed on the event loop: only its first ranges are read (60,000 empty ranges took
# 0.18 s), and an error quotes only its start.
MAX_ACCEPT_RANGES = 32
MAX_PARAMS = 8  # per range, the media type included
MAX_QUOTED = 100


def media_type(header: str | None) -> str:
    """'Image/JPEG; charset=x' → 'image/jpeg'; missing → ''."""
    return (header or "").split(";", 1)[0].strip().lower()


def _ranges(accept: str) -> dict[str, float]:
    ranges: dict[str, float] = {}
    for part in accept.split(",", MAX_ACCEPT_RANGES)[:MAX_ACCEPT_RANGES]:
        fields = [f.strip() for f in part.split(";", MAX_PARAMS)[:MAX_PARAMS]]
        q = 1.0
        for param in fields[1:]:
            if param.lower().startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        if fields[0]:
            ranges.setdefault(fields[0].lower(), q)
    return ranges


def negotiate(accept: str | None, offered: tuple[str, ...]) -> str:
    """The offered type the Accept header rates highest (most specific range wins); ties go
    to the order of `offered`. No header means the first offered."""
    if not accept or not accept.strip():
        return offered[0]
    ranges = _ranges(accept)
    best, best_q = None, 0.0
    for candidate in offered:
        for key in (candidate, candidate.split("/")[0] + "/*", "*/*"):
            if key in ranges:
                if ranges[key] > best_q:
                    best, best_q = candidate, ranges[key]
                break
    if best is None:
        shown = accept if len(accept) <= MAX_QUOTED else accept[:MAX_QUOTED] + "..."
        raise NotAcceptable(f"cannot produce any of {shown!r}; available: {', '.join(offered)}")
    return best
