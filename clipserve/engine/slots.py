"""Shared-memory slots: fixed-size cells of one file in /dev/shm, one file per front end.

The front end owns its file: it creates it, picks free slots and writes each item into one;
the engine maps the same file and reads the items in place (the worker's batch assembly is the
one copy), then writes each embedding back into its item's slot. A slot is reused only after
the engine has answered for it, so the two never write one slot at once.

A plain file and mmap rather than multiprocessing.shared_memory: its resource tracker would
unlink a segment when any process that merely attached to it exits (Python < 3.13). Names
carry the supervisor's pid, so the supervisor removes whatever a dead front end left; and a
supervisor holds a lock file for its life, so the next one removes what a killed one left.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import math
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
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


def _lock_path(supervisor_pid: int) -> Path:
    return shm_dir() / f"{segment_prefix(supervisor_pid)}lock"


def hold_lock(supervisor_pid: int) -> int:
    """Lock this supervisor's lock file for its life (the descriptor returned stays open; the
    kernel releases the lock when the process dies, even by SIGKILL). Locked under another
    name and then renamed into place, so a lock file that can be taken is a dead owner's."""
    path = _lock_path(supervisor_pid)
    fresh = path.with_name(f"{path.name}.new")
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(fresh, path)
    return fd


def release_lock(supervisor_pid: int, fd: int) -> None:
    _lock_path(supervisor_pid).unlink(missing_ok=True)
    os.close(fd)


_OWNER = re.compile(r"clipserve-(\d+)-")


def remove_stale(*directories: Path, keep: Path) -> dict[int, int]:
    """Remove what dead supervisors left in `directories` (segments, temp dirs): the entries
    named `clipserve-<pid>-...` whose supervisor is gone. Called by a supervisor at start with
    its lock held: of its own pid's entries it keeps only `keep` (its temp dir) and the lock;
    the rest are a killed predecessor's with the same pid. Returns the count per dead pid."""
    me = os.getpid()
    owned: dict[int, list[Path]] = {}
    for directory in dict.fromkeys(directories):
        for path in directory.glob("clipserve-*-*"):
            match = _OWNER.match(path.name)
            if match and path not in (keep, _lock_path(me)):
                owned.setdefault(int(match.group(1)), []).append(path)
    removed = {}
    for pid, paths in owned.items():
        with _if_dead(pid) if pid != me else contextlib.nullcontext(True) as dead:
            if not dead:
                continue
            lock = _lock_path(pid)
            for path in sorted(paths, key=lambda p: p == lock):  # the lock file last
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            removed[pid] = len(paths)
    return removed


@contextlib.contextmanager
def _if_dead(pid: int) -> Iterator[bool]:
    """Whether the supervisor `pid` is gone: its lock file can be taken (and is held while the
    block removes its files). No lock file: a clipserve from before lock files, gone when no
    process has its pid."""
    try:
        fd = os.open(_lock_path(pid), os.O_RDWR)
    except FileNotFoundError:
        yield not process_exists(pid)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        yield False  # held: its supervisor lives
    else:
        yield True
    finally:
        os.close(fd)


def process_exists(pid: int) -> bool:
    """Whether some process has this pid (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Up to this many rows are read or written one by one: indexing by a list of slots costs
# ~1 µs more than one row.
ROWS_ONE_BY_ONE = 4


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
            if create:  # ours (O_EXCL): left there, every retry under this name would fail
                path.unlink(missing_ok=True)
            raise
        self._fd = fd
        self._backed = 0  # slots below this have their pages allocated (see take)
        self._free = list(range(self.count))  # a min-heap: the lowest free slot first
        self._tables: dict[int, np.ndarray] = {}  # row length -> every slot's first row

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
        """The slot's bytes as an array, no copy. It holds the mapping (`close`)."""
        dt = np.dtype(dtype)
        # math.prod: np.prod costs a few µs a call, and a request makes four of these.
        size = math.prod(shape)  # negative with a negative dimension: refused too
        if not 0 <= size * dt.itemsize <= self.slot_bytes or not 0 <= slot < self.count:
            raise ValueError(f"slot {slot}: {shape} {dt} does not fit")
        # frombuffer, not ndarray(buffer=...): only frombuffer's array holds the mmap's buffer
        # while it lives, so that `close` cannot unmap the memory under it.
        return np.frombuffer(self._mm, dt, size, slot * self.slot_bytes).reshape(shape)

    def write(self, slot: int, array: np.ndarray) -> None:
        self.view(slot, array.dtype, array.shape)[...] = array

    def _table(self, dim: int) -> np.ndarray:
        """Every slot's first `dim` float32s, a row a slot: an embedding is read or written by
        indexing it, not by making an array over the slot each time (a third of the time)."""
        table = self._tables.get(dim)
        if table is None:
            if not 0 <= dim * 4 <= self.slot_bytes:
                raise ValueError(f"a row of {dim} float32 does not fit a slot")
            whole = np.frombuffer(self._mm, "<f4")  # holds the mapping, as `view`'s arrays do
            shape, strides = (self.count, dim), (self.slot_bytes, 4)
            table = np.lib.stride_tricks.as_strided(whole, shape, strides, writeable=True)
            self._tables[dim] = table
        return table

    def _check(self, slots: list[int]) -> None:
        if slots and (min(slots) < 0 or max(slots) >= self.count):
            raise ValueError(f"slots {slots} out of range")

    def write_rows(self, slots: list[int], rows: np.ndarray) -> None:
        """Row i of `rows` (float32, 2-D) into `slots[i]`."""
        if len(slots) != len(rows):
            raise ValueError(f"{len(rows)} rows for {len(slots)} slots")
        self._check(slots)
        table = self._table(rows.shape[1])
        if len(slots) > ROWS_ONE_BY_ONE:
            table[slots] = rows
            return
        for i, slot in enumerate(slots):
            table[slot] = rows[i]

    def read_rows(self, slots: list[int], dim: int) -> np.ndarray:
        """The float32 rows in `slots`, `dim` each, as a new array (the slots go back next)."""
        self._check(slots)
        table = self._table(dim)
        if len(slots) > ROWS_ONE_BY_ONE:
            return table[slots]  # a copy: indexing by a list
        rows = np.empty((len(slots), dim), "<f4")
        for i, slot in enumerate(slots):
            rows[i] = table[slot]
        return rows

    def close(self, *, unlink: bool = False) -> None:
        self._tables.clear()  # first: a table holds the mapping as long as it lives
        # Views still alive somewhere (an item still being copied into a batch when its front
        # end went away): the mmap refuses to close, and the mapping goes with the last of them.
        with contextlib.suppress(BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if unlink:
            self.path.unlink(missing_ok=True)
