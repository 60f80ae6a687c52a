"""Triton's system shared-memory regions: a client registers a POSIX shared-memory object
(`/dev/shm/<key>`, made with `shm_open`) and names it in requests, so tensors and embeddings
cross no socket.

Server-wide: with `--workers N` a register may reach one front end and the inference another,
so the table is a small JSON file in /dev/shm beside the slot files (removed with them),
rewritten under an exclusive `flock` and read under a shared one; in one process it is a dict.

Reads and writes use `pread`/`pwrite` on a descriptor opened per use, never a mapping: a client
that truncates its object after registering would turn a mapped read into SIGBUS, which Python
cannot catch, where `pread` just comes back short (a 400). Keys are checked (a name in
/dev/shm, not ours: a client must not make the server write into its own slot files), opened
with O_NOFOLLOW and must be regular files large enough for the region.

Off unless --shm-max-regions is above 0: as in Triton, a client that registers a region is
trusted with every object the server's user can open in /dev/shm, and regions are server-wide
(any client, any API key, sees and uses them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from clipserve.errors import InvalidParameter, InvalidTensor, PayloadTooLarge, Unsupported
from clipserve.protocol.shm import RegionRef

SHM = Path("/dev/shm")
_KEY = re.compile(r"/?[A-Za-z0-9._-]{1,200}")
_NAME = re.compile(r"[\x21-\x7e]{1,256}")
OURS = "clipserve"  # the server's own files: slots, budgets, buckets, this table
# Objects no client region may name: ours, and those Python's multiprocessing (semaphores,
# shared_memory) and torch's tensor sharing make in this process tree.
NOT_CLIENTS = (OURS, "sem.", "psm_", "torch_")


def _count(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        raise InvalidParameter(f"{field} must be a non-negative integer, got {value!r}")
    return value


class SharedMemoryLimit(PayloadTooLarge):
    """--shm-max-regions or --shm-max-bytes reached (gRPC: RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int


class SharedMemoryRegions:
    """Register, unregister, list, and read or write tensors in, the registered regions."""

    def __init__(self, max_regions: int, max_bytes: int, table: Path | None = None) -> None:
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.table = table  # None: this process's own
        self._own: dict[str, Region] = {}

    # The table

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[dict[str, Region]]:
        if self.table is None:
            yield self._own
            return
        fd = os.open(self.table, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            raw = os.pread(fd, os.fstat(fd).st_size, 0)
            regions = {r["name"]: Region(**r) for r in json.loads(raw or b"[]")}
            before = dict(regions)
            yield regions
            if exclusive and regions != before:
                data = json.dumps([asdict(r) for r in regions.values()]).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
        finally:
            os.close(fd)  # and the lock with it

    def close(self) -> None:
        """Nothing is held between calls: the table stays for the other front ends."""

    # The extension's calls

    def register(self, name: str, key: str, offset: object, byte_size: object) -> None:
        """`offset` and `byte_size` as the client sent them (checked here)."""
        if self.max_regions == 0:
            raise Unsupported(
                "system shared memory is off on this server (--shm-max-regions 0); it trusts "
                "a registering client with the server's /dev/shm, so the operator turns it on"
            )
        if _NAME.fullmatch(name) is None:
            raise InvalidParameter(f"region name {name[:40]!r}: 1 to 256 visible characters")
        offset, byte_size = _count(offset, "offset"), _count(byte_size, "byte_size")
        if byte_size == 0:
            raise InvalidParameter("byte_size must be above 0")
        fd = self._open(key)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if offset + byte_size > size:
            raise InvalidParameter(
                f"region {name!r}: offset {offset} + byte_size {byte_size} exceeds the "
                f"{size} bytes of shared memory object {key!r}"
            )
        with self._locked(exclusive=True) as regions:
            if name in regions:
                raise InvalidParameter(
                    f"shared memory region {name!r} is already registered; unregister it first"
                )
            if len(regions) >= self.max_regions:
                raise SharedMemoryLimit(
                    f"{len(regions)} regions are registered, the limit (--shm-max-regions)"
                )
            used = sum(r.byte_size for r in regions.values())
            if used + byte_size > self.max_bytes:
                raise SharedMemoryLimit(
                    f"registered regions would hold {used + byte_size} bytes; the limit is "
                    f"{self.max_bytes} (--shm-max-bytes)"
                )
            regions[name] = Region(name, key, offset, byte_size)

    def unregister(self, name: str | None = None) -> None:
        """One region, or every one; an unknown name is no error (as Triton)."""
        with self._locked(exclusive=True) as regions:
            if name is None:
                regions.clear()
            else:
                regions.pop(name, None)

    def status(self, name: str | None = None) -> list[Region]:
        with self._locked(exclusive=False) as regions:
            if name is None:
                return list(regions.values())
            if name not in regions:
                raise InvalidParameter(f"Unable to find system shared memory region: {name!r}")
            return [regions[name]]

    # Tensors

    def _region(self, ref: RegionRef, what: str) -> Region:
        with self._locked(exclusive=False) as regions:
            region = regions.get(ref.name)
        if region is None:
            raise InvalidTensor(f"{what}: shared memory region {ref.name!r} is not registered")
        if ref.offset + ref.byte_size > region.byte_size:
            raise InvalidTensor(
                f"{what}: offset {ref.offset} + byte_size {ref.byte_size} exceeds region "
                f"{ref.name!r}'s {region.byte_size} bytes"
            )
        return region

    def read(self, ref: RegionRef, max_bytes: int) -> bytes:
        """An input's bytes from its region: at most `max_bytes` (the caller's bound: what the
        input's shape needs, or --max-body-bytes), refused before anything is opened or read,
        as a region may be as large as --shm-max-bytes."""
        if ref.byte_size > max_bytes:
            raise PayloadTooLarge(
                f"input in shared memory region {ref.name!r}: {ref.byte_size} bytes, more "
                f"than the {max_bytes} it may hold"
            )
        region = self._region(ref, "input")
        fd = self._open(region.key)
        try:
            data = os.pread(fd, ref.byte_size, region.offset + ref.offset)
        finally:
            os.close(fd)
        if len(data) != ref.byte_size:  # the object shrank after it was registered
            raise InvalidTensor(
                f"shared memory region {ref.name!r} holds {len(data)} of the {ref.byte_size} "
                "bytes the input names (was it truncated?)"
            )
        return data

    def fits(self, ref: RegionRef, size: int) -> Region:
        """An output's region, once it is registered and `size` bytes fit where the request
        puts them: checked as the request is parsed, and again as the output is written (the
        region may be unregistered meanwhile)."""
        region = self._region(ref, "output")
        if size > ref.byte_size:
            raise InvalidTensor(
                f"output region {ref.name!r}: {ref.byte_size} bytes cannot hold the "
                f"{size}-byte output"
            )
        return region

    def write(self, ref: RegionRef, data: bytes) -> None:
        """An output's bytes into its region (at most the byte_size the request gave)."""
        region = self.fits(ref, len(data))
        fd = self._open(region.key)
        try:
            if os.fstat(fd).st_size < region.offset + ref.offset + len(data):
                raise InvalidTensor(f"shared memory region {ref.name!r} was truncated")
            os.pwrite(fd, data, region.offset + ref.offset)
        finally:
            os.close(fd)

    @staticmethod
    def _open(key: str) -> int:
        if not isinstance(key, str) or _KEY.fullmatch(key) is None:
            raise InvalidParameter(
                f"key {str(key)[:40]!r}: a POSIX shared memory name, such as /my_region"
            )
        name = key.lstrip("/")
        if name.startswith(NOT_CLIENTS) or name in (".", ".."):
            raise InvalidParameter(f"key {key!r} is not a client's shared memory object")
        try:
            fd = os.open(SHM / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise InvalidParameter(
                f"cannot open shared memory object {key!r}: {e.strerror}"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidParameter(f"shared memory object {key!r} is not a regular file")
        return fd
