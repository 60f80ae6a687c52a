"""Walking folders for photos: content hash, size and a header check per file.

A file is a candidate by its suffix (hidden files and folders are passed over); it is a photo
if Pillow opens its header as JPEG, PNG or WebP (HEIC/HEIF too where the pillow-heif plugin is
importable). Anything that fails is skipped with its reason and one log line; nothing aborts
the run. A file the manifest already knows (same path, size, mtime, ctime and inode) is not
read again: a copy that puts the mtime back (`cp -p`, `rsync -t`, `touch -r`) still changes the
ctime. A file name that is not UTF-8 is skipped (the reports are UTF-8 text), named escaped.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

log = logging.getLogger(__name__)

SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})
HEIF_SUFFIXES = frozenset({".heic", ".heif"})
FORMATS = ("JPEG", "PNG", "WEBP")
HEIF_FORMAT = "HEIF"
# Reading and hashing is I/O bound (hashlib and file reads release the GIL).
READ_WORKERS = 4


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


def heif_available() -> bool:
    """Whether HEIC/HEIF files can be read: only with the pillow-heif plugin, registered here
    (not at import) so a plain run never pays for it."""
    try:
        import pillow_heif  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


def scan(roots: Iterable[str | Path], known: Mapping[str, Photo] | None = None) -> Scan:
    """Every photo under `roots` (folders or files), in path order. `known` maps paths to what
    an earlier run found; an entry with the same size, times, inode and link status is
    trusted without reading."""
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
            to_read, pool.map(lambda c: _read(c[0], c[1], formats), to_read), strict=True
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
        if os.path.isfile(top):
            names = [top]
        elif os.path.isdir(top):
            names = list(_files_under(top, result))
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


def _read(path: str, st: os.stat_result, formats: tuple[str, ...]) -> Photo | str:
    """The photo, or why it is skipped."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
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
