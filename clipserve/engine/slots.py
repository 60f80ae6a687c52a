"""Shared-memory slots: fixed-size cells of one file in /dev/shm, one file per front end.

The front end owns its file: it creates it, picks free slots and writes each item into one;
the engine maps the same file and reads the items in place (the worker's batch assembly is the
one copy), then writes each embedding back into its item's slot. A slot is reused only after
the engine has answered for it, so the two never write one slot at once.

A plain file and mmap rather than multiprocessing.shared_memory: its resource tracker would
unlink a segment when any process that merely attached to it exits (Python < 3.13). Names
carry the supervisor's pid, so the supervisor removes whatever a dead front end left.
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

from clipserve.errors import Overloaded


def shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def segment_prefix(supervisor_pid: int) -> str:
    return f"clipserve-{supervisor_pid}-"


def segment_path(supervisor_pid: int, frontend_pid: int, generation: int = 0) -> Path:
    """A front end's file; a new generation for each connection to the engine."""
    return shm_dir() / f"{segment_prefix(supervisor_pid)}{frontend_pid}.{generation}"


def remove_segments(supervisor_pid: int, pid: int | None = None) -> int:
    """Unlink one front end's files (or all of this supervisor's); returns how many."""
    pattern = f"{segment_prefix(supervisor_pid)}{pid if pid is not None else '*'}.*"
    removed = 0
    for path in shm_dir().glob(pattern):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


class SlotArena:
    """`count` slots of `slot_bytes` each. Sparse: tmpfs backs only the pages written, and free
    slots are reused lowest first, so memory follows the peak in flight, not `count`."""

    def __init__(self, path: Path, count: int, slot_bytes: int, *, create: bool) -> None:
        self.path = path
        self.count = count
        self.slot_bytes = -(-slot_bytes // 64) * 64  # cache-line aligned cells
        size = self.count * self.slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"{path}: smaller than {count} slots of {slot_bytes} bytes")
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._backed = 0  # slots below this have their pages allocated (see take)
        self._free = list(range(self.count))  # a min-heap: the lowest free slot first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """n free slots. Pages are allocated before a slot is first written: a full /dev/shm
        (Docker's default is 64 MiB) is then a 503, not a SIGBUS that kills the process."""
        if n > len(self._free):
            in_use = f"all {self.count} shared-memory slots of this front end are in use"
            raise Overloaded(f"{in_use}; retry later")
        slots = [heapq.heappop(self._free) for _ in range(n)]
        top = max(slots) + 1
        if top > self._backed:
            try:
                os.posix_fallocate(self._fd, 0, top * self.slot_bytes)
            except OSError as e:
                self.give_back(slots)
                raise Overloaded(
                    f"shared memory is full ({self.path.parent}: {e.strerror}); give the "
                    "container more (docker --shm-size) or lower --workers; retry later"
                ) from None
            self._backed = top
        return slots

    def give_back(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)

    def view(self, slot: int, dtype: np.dtype | str, shape: tuple[int, ...]) -> np.ndarray:
        """The slot's bytes as an array, no copy."""
        dt = np.dtype(dtype)
        if int(np.prod(shape)) * dt.itemsize > self.slot_bytes or not 0 <= slot < self.count:
            raise ValueError(f"slot {slot}: {shape} {dt} does not fit")
        return np.ndarray(shape, dt, buffer=self._mm, offset=slot * self.slot_bytes)

    def write(self, slot: int, array: np.ndarray) -> None:
        self.view(slot, array.dtype, array.shape)[...] = array

    def close(self, *, unlink: bool = False) -> None:
        # Views still alive somewhere: the mapping goes with the last of them.
        with contextlib.suppress(BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if unlink:
            self.path.unlink(missing_ok=True)
