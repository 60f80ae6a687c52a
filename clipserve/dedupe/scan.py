"""Walking folders for photos: content hash, size and a header check per file.

A file is a candidate by its suffix (hidden files and folders are passed over); it is a photo
if Pillow opens its header as JPEG, PNG or WebP (HEIC/HEIF too where the pillow-heif plugin is
importable). Anything that fails is skipped with its reason and one log line; nothing aborts
the run. Only regular files are opened (a FIFO, socket or device named like a photo would block
or never end) and at most MAX_FILE_BYTES of each is read. A file the manifest already knows
(same path, size, mtime, ctime and inode) is not read again: a copy that puts the mtime back
(`cp -p`, `rsync -t`, `touch -r`) still changes the ctime. A file name that is not UTF-8 is
skipped (the reports are UTF-8 text), named escaped.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

log = logging.getLogger(__name__)

SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})
HEIF_SUFFIXES = frozenset({".heic", ".heif"})
FORMATS = ("JPEG", "PNG", "WEBP")
HEIF_FORMAT = "HEIF"
# Reading and hashing is I/O bound (hashlib and file reads release the GIL).
READ_WORKERS = 4
# The most bytes read from one file: each is held whole in memory to hash it, READ_WORKERS at a
# time. No camera's photo comes near it (a 200 MP phone JPEG is tens of MB) and the image under
# it would be past Pillow's decompression-bomb limit anyway.
MAX_FILE_BYTES = 200 * 1024 * 1024
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


@dataclass(frozen=True)
class Photo:
    """One readable photo: `path` is absolute (symlinks kept as named, `link` says so),
    `sha256` its bytes."""

    path: str
    size: int
    mtime_ns: int
    sha256: str
    width: int
    height: int
    format: str
    ctime_ns: int = 0
    ino: int = 0
    link: bool = False


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass
class Scan:
    photos: list[Photo] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    ignored: int = 0  # hidden files and files whose suffix is not a photo's
    read: int = 0  # files read and hashed this run (the rest the manifest knew)


class NotRead(Exception):
    """A file that is not read: its message is the reason it is skipped."""


def heif_available() -> bool:
    """Whether HEIC/HEIF files can be read: only with the pillow-heif plugin, registered here
    (not at import) so a plain run never pays for it."""
    try:
        import pillow_heif  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


def scan(
    roots: Iterable[str | Path],
    known: Mapping[str, Photo] | None = None,
    max_bytes: int = MAX_FILE_BYTES,
) -> Scan:
    """Every photo under `roots` (folders or files), in path order. `known` maps paths to what
    an earlier run found; an entry with the same size, times, inode and link status is
    trusted without reading. A file of more than `max_bytes` is skipped."""
    known = known or {}
    heif = heif_available()
    suffixes = SUFFIXES | HEIF_SUFFIXES if heif else SUFFIXES
    formats = (*FORMATS, HEIF_FORMAT) if heif else FORMATS
    result = Scan()
    candidates: list[tuple[str, os.stat_result]] = []
    for path in _walk(roots, result):
        if Path(path).suffix.lower() not in suffixes:
            result.ignored += 1
            continue
        if shown(path) != path:
            _skip(result, path, "the file name is not valid UTF-8")
            continue
        try:
            st = os.stat(path)
        except OSError as e:
            _skip(result, path, f"cannot stat: {e.strerror or e}")
            continue
        if not stat.S_ISREG(st.st_mode):  # never opened: that could block or have effects
            _skip(result, path, _not_regular(st))
            continue
        candidates.append((path, st))

    to_read: list[tuple[str, os.stat_result]] = []
    found: dict[str, Photo] = {}
    for path, st in candidates:
        old = known.get(path)
        if old is not None and _unchanged(old, path, st):
            found[path] = old
        else:
            to_read.append((path, st))
    with ThreadPoolExecutor(READ_WORKERS) as pool:
        for (path, _), outcome in zip(
            to_read, pool.map(lambda c: _read(c[0], c[1], formats, max_bytes), to_read), strict=True
        ):
            if isinstance(outcome, Photo):
                found[path] = outcome
            else:
                _skip(result, path, outcome)
    result.read = len(to_read)
    result.photos = [found[p] for p, _ in candidates if p in found]
    if not heif and any(Path(p).suffix.lower() in HEIF_SUFFIXES for p, _ in candidates):
        log.info("HEIC/HEIF files are passed over: pip install pillow-heif to read them")
    return result


def _walk(roots: Iterable[str | Path], result: Scan) -> Iterable[str]:
    seen: set[str] = set()
    for root in roots:
        top = os.path.abspath(root)
        if os.path.isdir(top):
            names = list(_files_under(top, result))
        elif os.path.exists(top):  # a file, or a FIFO or device that scan() then skips
            names = [top]
        else:
            _skip(result, top, "no such file or folder")
            continue
        for name in names:
            if name not in seen:  # overlapping roots name a file once
                seen.add(name)
                yield name


def _files_under(top: str, result: Scan) -> Iterable[str]:
    def report(e: OSError) -> None:
        _skip(result, e.filename or top, f"cannot list folder: {e.strerror or e}")

    # Symlinked folders are not followed: a link back up the tree would loop.
    for folder, dirs, files in os.walk(top, onerror=report):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                result.ignored += 1
                continue
            yield os.path.join(folder, name)


def open_photo(path: str) -> BinaryIO:
    """The file opened for reading, if it is a regular file once opened: non-blocking, so a
    FIFO put in its place after the scanner's stat cannot hang the open (NotRead if not)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRead(_not_regular(st))
        os.set_blocking(fd, True)  # for the open only: some network file systems honour it
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_bounded(path: str, max_bytes: int) -> bytes:
    """The file's bytes (NotRead past `max_bytes`)."""
    with open_photo(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = b"" if size > max_bytes else _read_at_most(f, size, max_bytes)
    if size > max_bytes or len(data) > max_bytes:
        raise NotRead(f"too large to be a photo (over {_bytes(max_bytes)})")
    return data


def _read_at_most(f: BinaryIO, size: int, max_bytes: int) -> bytes:
    """At most `max_bytes` + 1 bytes of `f`: first `size` (what fstat says, so a small file
    allocates little) and one more; a file that grew, or a /proc file that says 0, is read on
    only to the bound."""
    data = f.read(size + 1)
    if len(data) > size:
        data += f.read(max_bytes + 1 - len(data))
    return data


def _read(path: str, st: os.stat_result, formats: tuple[str, ...], max_bytes: int) -> Photo | str:
    """The photo, or why it is skipped."""
    try:
        return _decode(path, st, formats, _read_bounded(path, max_bytes))
    except NotRead as e:
        return str(e)
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    except MemoryError:  # one file's fault, not the run's: its memory is freed by now
        return "cannot read: out of memory"


def _decode(path: str, st: os.stat_result, formats: tuple[str, ...], data: bytes) -> Photo | str:
    try:
        with Image.open(io.BytesIO(data), formats=formats) as img:
            width, height = img.size
            fmt = str(img.format)
    except UnidentifiedImageError:
        return "not a readable " + "/".join(formats) + " image"
    except Image.DecompressionBombError as e:
        return f"too large to decode safely ({e})"
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        return f"unreadable image header ({e})"
    return Photo(
        path=path,
        size=len(data),
        mtime_ns=st.st_mtime_ns,
        sha256=hashlib.sha256(data).hexdigest(),
        width=width,
        height=height,
        format=fmt,
        ctime_ns=st.st_ctime_ns,
        ino=st.st_ino,
        link=os.path.islink(path),
    )


def _not_regular(st: os.stat_result) -> str:
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "")
    return f"not a regular file ({kind})" if kind else "not a regular file"


def _bytes(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n} bytes"


def _unchanged(old: Photo, path: str, st: os.stat_result) -> bool:
    now = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, os.path.islink(path))
    return (old.size, old.mtime_ns, old.ctime_ns, old.ino, old.link) == now


def shown(path: str) -> str:
    """The path as the reports write it: a name that is not UTF-8 (its bytes kept by Python
    as surrogates) with those bytes escaped, `caf\\xe9.jpg`; any other path as it is."""
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:  # a lone surrogate that no file name decoded to
        raw = path.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def _skip(result: Scan, path: str, reason: str) -> None:
    path = shown(path)
    log.warning("skipped %s: %s", path, reason)
    result.skipped.append(Skipped(path, reason))
