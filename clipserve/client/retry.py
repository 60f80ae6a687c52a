"""When to try a request again: exponential backoff with jitter, never sooner than the
server's `Retry-After`."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime


@dataclass(frozen=True)
class RetryPolicy:
    """`retries` more attempts after the first. Without Retry-After the n-th wait is
    `base_s * 2**n` capped at `cap_s`, times a random factor in [0.5, 1) so clients that
    failed together do not return together; with it, at least what the server asked, up to
    20% more, and never more than `max_wait_s`."""

    retries: int = 5
    base_s: float = 0.25
    cap_s: float = 8.0
    max_wait_s: float = 60.0

    def delay(self, attempt: int, retry_after_s: float | None, rng: random.Random) -> float:
        backoff = min(self.cap_s, self.base_s * 2.0**attempt) * rng.uniform(0.5, 1.0)
        if retry_after_s is None:
            return backoff
        return min(self.max_wait_s, max(backoff, retry_after_s * rng.uniform(1.0, 1.2)))


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date; None if absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
