"""Token buckets that every front end shares: a small open-addressing table in one mmap.

With `--workers N` the supervisor creates the file (in /dev/shm) and every front end maps it,
so a key's quota holds across front ends whichever one a connection reaches; in one process
the table is anonymous memory. A slot is (bucket id: 16 bytes, tokens, last update, when full):
a bucket's rate is not stored but read from each process's key file, so a reload applies at
once. Updates take an exclusive `flock` on the file: a few microseconds, and the kernel drops
it if its holder dies, where a crashed front end would leave a semaphore taken for good.

A bucket that has refilled is the same as one never seen, so its slot may be reused: the table
never needs clearing, and keys removed from the file fade out on their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import struct
import time
from pathlib import Path

from clipserve.http.keys import MAX_BUCKETS, Rate

log = logging.getLogger(__name__)
SLOTS = 2 * MAX_BUCKETS  # half full at most: probe chains stay short
_SLOT = struct.Struct("<16sddd")  # bucket id, tokens, updated (monotonic s), full at
SIZE = SLOTS * _SLOT.size
_EMPTY = bytes(16)


class BucketTable:
    """`take` and `give_back` tokens of named buckets; `path` None: this process's only."""

    def __init__(self, path: str | None = None, *, create: bool = False) -> None:
        self.path = path
        self._fd = -1
        # One process, one event loop: nothing runs between a take's read and its write.
        self._lock: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if path is None:
            self._mm = mmap.mmap(-1, SIZE)
            return
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SIZE)  # sparse: pages are backed as slots are first used
            self._mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._lock = _Flock(fd)

    def close(self) -> None:
        self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @staticmethod
    def remove(path: str) -> None:
        Path(path).unlink(missing_ok=True)

    def take(self, bucket: bytes, need: float, threshold: float, rate: Rate) -> float:
        """Take `need` tokens if at least `threshold` are there (the bucket may go below zero:
        a request larger than the burst passes when it is full, and its debt is paid back at the
        rate). Returns 0.0 if taken, else the seconds until `threshold` tokens will be there."""
        now = time.monotonic()
        with self._lock:
            at = self._find(bucket, now)
            if at < 0:  # no room: never with at most MAX_BUCKETS live buckets; fail open
                log.warning("rate limit table full; request not limited")
                return 0.0
            tokens = self._tokens(at, bucket, now, rate)
            if tokens < threshold:
                return (threshold - tokens) / rate.per_s
            self._store(at, bucket, tokens - need, now, rate)
        return 0.0

    def give_back(self, bucket: bytes, tokens: float, rate: Rate) -> None:
        """Tokens taken for a request the server then could not serve (its queue was full)."""
        now = time.monotonic()
        with self._lock:
            at = self._find(bucket, now)
            if at >= 0:
                self._store(
                    at,
                    bucket,
                    min(rate.burst, self._tokens(at, bucket, now, rate) + tokens),
                    now,
                    rate,
                )

    def available(self, bucket: bytes, rate: Rate) -> float:
        now = time.monotonic()
        with self._lock:
            at = self._find(bucket, now)
            return rate.burst if at < 0 else self._tokens(at, bucket, now, rate)

    def _find(self, bucket: bytes, now: float) -> int:
        """The slot holding `bucket`, or a free one for it (its id still elsewhere, or zero
        tokens then read as a full bucket); -1 if the table has no room."""
        mm = self._mm
        start = int.from_bytes(bucket[:8], "little") % SLOTS
        reusable = -1
        for probe in range(SLOTS):
            at = (start + probe) % SLOTS * _SLOT.size
            held = mm[at : at + 16]
            if held == bucket:
                return at
            if held == _EMPTY:
                return at if reusable < 0 else reusable
            if reusable < 0 and _SLOT.unpack_from(mm, at)[3] <= now:
                reusable = at  # refilled: as good as absent, so its place can be taken
        return reusable

    def _tokens(self, at: int, bucket: bytes, now: float, rate: Rate) -> float:
        held, tokens, updated, _ = _SLOT.unpack_from(self._mm, at)
        if held != bucket:  # a free slot: a bucket not seen lately is full
            return rate.burst
        refilled: float = tokens + (now - updated) * rate.per_s
        return min(rate.burst, refilled)

    def _store(self, at: int, bucket: bytes, tokens: float, now: float, rate: Rate) -> None:
        full_at = now + max(0.0, rate.burst - tokens) / rate.per_s
        _SLOT.pack_into(self._mm, at, bucket, tokens, now, full_at)


class _Flock:
    """An exclusive flock for a `with` block (a class: a generator-based context manager costs
    a microsecond more per take)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def retry_after(seconds: float) -> int:
    """Retry-After is whole seconds: rounded up, at least 1."""
    return max(1, math.ceil(seconds))
