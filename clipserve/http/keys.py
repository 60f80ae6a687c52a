"""The API key file (`--api-keys`): its lines, the keys as hashes, and its reloading.

One key a line: `KEY`, `NAME:KEY` or `NAME:KEY:RATE[:BURST]` (that key's own `--rate-limit`);
blank lines and `#` comments are skipped. Keys are kept only as SHA-256 digests, looked up in a
dict: what a lookup's timing could tell is how a guess's digest compares with the stored ones,
which says nothing about any key (and a dict costs the same for 1 key or 10,000, unlike
comparing with each in turn).

Lines of one NAME share a quota (a team rotating its key keeps one bucket), so they must agree
on its rate; a key without a name has a quota of its own, labelled by its digest's first 8 hex
digits in metrics (`printf %s KEY | sha256sum`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from clipserve.errors import StartupError

log = logging.getLogger(__name__)
RELOAD_CHECK_S = 1.0  # how often the file's mtime and size are looked at
MAX_BUCKETS = 16_384  # distinct quotas a file may define (the shared table holds twice that)
MIN_KEY_CHARS = 8
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEY = re.compile(r"[!-~]+")  # visible ASCII; ':' is refused separately (it splits the fields)
_COMMENT = re.compile(r"\s#.*$")
_RATE = re.compile(r"(\d+(?:\.\d+)?)(?::(\d+))?")


@dataclass(frozen=True)
class Rate:
    """A token bucket's refill (items per second) and depth (the largest burst)."""

    per_s: float
    burst: float


def parse_rate(text: str, where: str) -> Rate:
    """`RATE[:BURST]`; the burst defaults to one second's worth (at least one item)."""
    match = _RATE.fullmatch(text)
    if match is None:
        raise StartupError(f"{where}: expected RATE or RATE:BURST (e.g. 50:100), got {text!r}")
    per_s = float(match.group(1))
    burst = float(match.group(2)) if match.group(2) else max(1.0, math.ceil(per_s))
    if per_s <= 0 or burst < 1:
        raise StartupError(f"{where}: the rate must be positive and the burst at least 1")
    return Rate(per_s, burst)


@dataclass(frozen=True)
class Grant:
    """Who a request is for, as the quota sees it: a bucket (16 bytes naming it in the shared
    table), its metrics label and its rate (None: unlimited)."""

    bucket: bytes
    label: str
    rate: Rate | None


def bucket_id(identity: str) -> bytes:
    return hashlib.sha256(identity.encode()).digest()[:16]


def anonymous(rate: Rate | None) -> Grant:
    """Everyone, when there is no key file: one bucket for the whole server."""
    return Grant(bucket_id("anonymous"), "anonymous", rate)


@dataclass(frozen=True)
class KeyRing:
    """The keys of one reading of the file, by SHA-256 digest."""

    grants: dict[bytes, Grant] = field(default_factory=dict)

    def find(self, key: bytes) -> Grant | None:
        return self.grants.get(hashlib.sha256(key).digest())

    def __len__(self) -> int:
        return len(self.grants)


def parse_keys(text: str, source: str, default: Rate | None) -> KeyRing:
    """A key file's text; raises StartupError naming `source` and the line."""
    grants: dict[bytes, Grant] = {}
    rates: dict[str, Rate | None] = {}  # by name: the lines of one name must agree
    for number, fields in _key_lines(text):
        where = f"--api-keys {source}, line {number}"
        if len(fields) > 4:
            raise StartupError(f"{where}: expected KEY, NAME:KEY or NAME:KEY:RATE[:BURST]")
        name, key = _name_and_key(fields)
        if name is not None and _NAME.fullmatch(name) is None:
            raise StartupError(f"{where}: a name is 1 to 64 of A-Z a-z 0-9 _ . -")
        if _KEY.fullmatch(key) is None or len(key) < MIN_KEY_CHARS:
            problem = f"a key is at least {MIN_KEY_CHARS} visible ASCII characters, no ':'"
            raise StartupError(f"{where}: {problem}")
        rate = parse_rate(":".join(fields[2:]), where) if len(fields) > 2 else default
        digest = hashlib.sha256(key.encode()).digest()
        if digest in grants:
            raise StartupError(f"{where}: the same key is on an earlier line")
        if name is None:
            label = "sha256:" + digest.hex()[:8]  # no name holds ':', so none can clash
            grants[digest] = Grant(bucket_id("key:" + digest.hex()), label, rate)
            continue
        if rates.setdefault(name, rate) != rate:
            raise StartupError(f"{where}: {name!r} has another rate on an earlier line")
        grants[digest] = Grant(bucket_id("name:" + name), name, rate)
    if not grants:  # more likely a file caught mid-write than a wish to refuse everyone
        raise StartupError(f"--api-keys {source}: holds no keys")
    if len({g.bucket for g in grants.values()}) > MAX_BUCKETS:
        raise StartupError(f"--api-keys {source}: more than {MAX_BUCKETS} names and unnamed keys")
    return KeyRing(grants)


def _key_lines(text: str) -> Iterator[tuple[int, list[str]]]:
    """Each line that holds a key, numbered from 1, split into its fields."""
    for number, raw in enumerate(text.splitlines(), 1):
        # A comment starts a line or follows a blank: a key has no blank, so `k#1` is a key.
        line = _COMMENT.sub("", raw).strip()
        if line and not line.startswith("#"):
            yield number, line.split(":")


def keys_named(text: str) -> set[bytes]:
    """The digests of every key a key file's text names, its other fields unchecked."""
    return {hashlib.sha256(_name_and_key(f)[1].encode()).digest() for _, f in _key_lines(text)}


def _name_and_key(fields: list[str]) -> tuple[str | None, str]:
    """`KEY`, or `NAME:KEY[:...]`."""
    return (None, fields[0]) if len(fields) == 1 else (fields[0], fields[1])


def read_keys(path: str, default: Rate | None) -> KeyRing:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StartupError(f"--api-keys {path}: cannot read it ({e})") from None
    return parse_keys(text, path, default)


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeyFile:
    """The key file's current keys (`ring`), reloaded by a thread of its own when its mtime,
    size or inode changes (looked at once a second) or when `reload_soon` is called (SIGHUP).
    A file that no longer parses keeps those of the keys loaded before that it still names
    (removals apply, additions wait for a file that parses), and says so in one log line; one
    that cannot be read, is empty or ends mid-line keeps them all.
    The event loop only reads `ring`: the file is never read on it."""

    def __init__(self, path: str, default: Rate | None) -> None:
        self.path = path
        self.default = default
        self._seen = _signature(path)
        self.ring = read_keys(path, default)  # a bad file at startup: StartupError
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="clipserve-keys", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def reload_soon(self) -> None:
        """Reload now, changed or not (safe from a signal handler or another thread)."""
        self._wake.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            forced = self._wake.wait(RELOAD_CHECK_S)
            self._wake.clear()
            if not self._stop.is_set():
                self.check(forced)

    def check(self, forced: bool = False) -> None:
        seen = _signature(self.path)
        if seen == self._seen and not forced:
            return
        self._seen = seen  # a bad version is reported once, not every second
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:  # gone or unreadable: nothing to go by
            log.error(
                "--api-keys %s: cannot read it (%s); keeping the %d keys loaded before",
                self.path,
                e,
                len(self.ring),
            )
            return
        try:
            ring = parse_keys(text, self.path, self.default)
        except StartupError as e:
            # Removals still apply: a typo on one line must not keep a key revoked on another
            # valid. Only keys the old file had and the new one still names stay; unless the
            # text looks caught mid-write (empty, or its last line unfinished): then all stay,
            # and the finished file, a new version, is read within a second.
            named = keys_named(text)
            if not named or not text.endswith("\n"):
                log.error("%s; keeping the %d keys loaded before", e, len(self.ring))
                return
            kept = {d: g for d, g in self.ring.grants.items() if d in named}
            dropped = len(self.ring) - len(kept)
            log.error(
                "%s; keeping the %d keys loaded before that it still names (%d dropped)",
                e,
                len(kept),
                dropped,
            )
            self.ring = KeyRing(kept)
            return
        self.ring = ring
        log.info("--api-keys %s: %d keys loaded", self.path, len(ring))
