"""--max-body-bytes-in-flight across the front ends of `--workers N`: one shared table.

The file (in /dev/shm, named for the supervisor so its shutdown removes it) holds one slot per
front-end index: (pid, bytes of request bodies that front end holds). A front end is the only
writer of its slot, so one that dies and is restarted at the same index zeroes its own slot:
nothing leaks. A reservation sums the slots under an exclusive `flock` (the kernel drops it if
its holder dies); a release only lowers its own slot, without the lock. Bytes of a front end
that died and was not yet restarted are dropped when they would cause a refusal.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

from clipserve.engine.slots import process_exists, segment_prefix, shm_dir
from clipserve.errors import Overloaded, StartupError
from clipserve.http.request import BodyBudget

SLOTS = 256  # the most front ends (--workers)
_SLOT = struct.Struct("<qq")  # owner pid, bytes held
SIZE = SLOTS * _SLOT.size


def budget_path(supervisor_pid: int) -> Path:
    """Matches the supervisor's `{segment_prefix}*.*` cleanup; no front end's pid is `body`."""
    return shm_dir() / f"{segment_prefix(supervisor_pid)}body.budget"


class SharedBodyBudget(BodyBudget):
    """A `BodyBudget` whose capacity every front end of one supervisor shares."""

    def __init__(self, capacity: int, path: Path, index: int, front_ends: int) -> None:
        """Maps (creating if need be) the table at `path` and takes slot `index` of
        `front_ends`, zeroing it."""
        super().__init__(capacity)
        if not 0 <= index < front_ends <= SLOTS:
            raise ValueError(f"front end {index} of {front_ends}: the table holds {SLOTS}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StartupError(f"body budget table {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < SIZE:  # the first front end to start sizes it
                os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
            _SLOT.pack_into(self._mm, index * _SLOT.size, os.getpid(), 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._at = index * _SLOT.size + 8  # this front end's byte count
        self._all = struct.Struct(f"<{2 * front_ends}q")  # every slot in use, in one read
        self._bytes = struct.Struct("<q")

    def reserve(self, n: int) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            slots = self._all.unpack_from(self._mm)
            if sum(slots[1::2]) + n > self.capacity and sum(self._live(slots)) + n > self.capacity:
                raise Overloaded(
                    f"request bodies in memory across the front ends would exceed "
                    f"{self.capacity} bytes (--max-body-bytes-in-flight); retry later"
                )
            self.used += n
            self._bytes.pack_into(self._mm, self._at, self.used)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def release(self, n: int) -> None:
        if n:
            self.used -= n
            self._bytes.pack_into(self._mm, self._at, self.used)

    def _live(self, slots: tuple[int, ...]) -> list[int]:
        """Bytes held by front ends still alive; a dead one's slot is zeroed (under the lock,
        so its successor, which takes the lock to start, cannot be overwritten)."""
        held = []
        for i in range(0, len(slots), 2):
            pid, size = slots[i], slots[i + 1]
            if size and pid > 0 and pid != os.getpid() and not process_exists(pid):
                _SLOT.pack_into(self._mm, i // 2 * _SLOT.size, pid, 0)
                size = 0
            held.append(size)
        return held

    def close(self) -> None:
        self.release(self.used)
        self._mm.close()
        os.close(self._fd)
