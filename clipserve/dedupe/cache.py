"""What survives between runs, in `--cache DIR`: the manifest of files seen, and embeddings.

`manifest.json` lists each photo's path, size, mtime, ctime, inode, whether it is a symlink,
content hash and pixel size: a file with all of these unchanged is not read again. Embeddings
are kept by content hash, per model identity (the server's `/info` "model", e.g.
"ViT-B-32/laion2b_s34b_b79k"), under `embeddings/<model>/part-*.npz`: a part is written after
every batch the server answers, so an interrupted run loses at most one batch, and a renamed
or copied file is never embedded again. A model with random weights ("<name>/random") stands
for no trained model (its weights follow torch's generator, and a fake backend takes the same
name): its embeddings are never kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import orjson

from clipserve.dedupe.scan import Photo

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2  # 2: ctime, inode and symlink too (a version 1 manifest is read again)
# Parts are merged into one file once there are more than this many (startup reads them all).
MAX_PARTS = 64


def load_manifest(directory: Path) -> dict[str, Photo]:
    """The photos an earlier run recorded, by path; empty if none (or unreadable: logged)."""
    path = directory / MANIFEST
    if not path.exists():
        return {}
    try:
        data = orjson.loads(path.read_bytes())
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"version {data.get('version')!r}")
        photos = [Photo(**entry) for entry in data["photos"]]
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("ignoring the manifest %s (%s): every file is read again", path, e)
        return {}
    return {p.path: p for p in photos}


def save_manifest(directory: Path, photos: Iterable[Photo]) -> None:
    entries = [
        {
            "path": p.path,
            "size": p.size,
            "mtime_ns": p.mtime_ns,
            "sha256": p.sha256,
            "width": p.width,
            "height": p.height,
            "format": p.format,
            "ctime_ns": p.ctime_ns,
            "ino": p.ino,
            "link": p.link,
        }
        for p in photos
    ]
    body = {"version": MANIFEST_VERSION, "photos": entries}
    _write_atomic(directory / MANIFEST, orjson.dumps(body, option=orjson.OPT_INDENT_2))


def carried_over(
    known: Mapping[str, Photo], roots: Iterable[str | Path], seen: Iterable[str]
) -> list[Photo]:
    """The earlier entries a run keeps beside the photos it found: those outside its roots
    whose file still exists (a later run may scan their folder again). One under its roots
    that it did not find was deleted or is no photo now: forgotten, so the manifest does not
    grow for ever with a library's churn."""
    tops = {os.path.abspath(r) for r in roots}
    under = tuple(top.rstrip(os.sep) + os.sep for top in tops)
    found = set(seen)
    return [
        photo
        for path, photo in known.items()
        if path not in found
        and path not in tops
        and not path.startswith(under)
        and os.path.lexists(path)
    ]


class EmbeddingStore:
    """Embeddings by content hash for one model, on disk under `directory`."""

    def __init__(self, directory: Path, model: str, embed_dim: int, variant: str = "") -> None:
        """`model` is the server's model identity; random weights ("…/random") are kept in
        memory for this run only. `variant` names preprocessing other than open_clip's (its
        embeddings are kept apart; "" keeps the folder of caches made before variants)."""
        self.model = model
        self.embed_dim = embed_dim
        self.persistent = not model.endswith("/random")
        key = f"{model}\n{variant}" if variant else model
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        slug = _slug(f"{model}-{variant}" if variant else model)
        self.directory = directory / "embeddings" / f"{slug}-{digest}"
        self._rows: dict[str, np.ndarray] = {}
        self._parts = 0
        if not self.persistent:
            log.info("%s has random weights: its embeddings are not cached between runs", model)
            return
        for part in sorted(self.directory.glob("part-*.npz")):
            self._load(part)
            self._parts = max(self._parts, _part_number(part))

    def __contains__(self, sha256: object) -> bool:
        return sha256 in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def missing(self, hashes: Iterable[str]) -> list[str]:
        return [h for h in hashes if h not in self._rows]

    def vectors(self, hashes: Sequence[str]) -> np.ndarray:
        """(len(hashes), embed_dim) float32, in the order asked; every hash must be stored."""
        if not hashes:
            return np.zeros((0, self.embed_dim), np.float32)
        return np.stack([self._rows[h] for h in hashes]).astype(np.float32, copy=False)

    def add(self, hashes: Sequence[str], vectors: np.ndarray) -> None:
        """Store rows (written to disk at once: the run can stop at any point after)."""
        if len(hashes) != len(vectors) or vectors.shape[1:] != (self.embed_dim,):
            raise ValueError(f"{len(hashes)} hashes for vectors of shape {vectors.shape}")
        if not len(hashes):
            return
        vectors = np.ascontiguousarray(vectors, np.float32)
        for h, row in zip(hashes, vectors, strict=True):
            self._rows[h] = row
        if self.persistent:
            self._parts += 1
            self._write_part(self._parts, list(hashes), vectors)

    def compact(self) -> None:
        """Merge the parts into one once there are many (the next run starts faster)."""
        parts = sorted(self.directory.glob("part-*.npz")) if self.persistent else []
        if len(parts) <= MAX_PARTS:
            return
        hashes = list(self._rows)
        self._parts += 1
        self._write_part(self._parts, hashes, self.vectors(hashes))
        for part in parts:
            part.unlink()

    def _write_part(self, number: int, hashes: list[str], vectors: np.ndarray) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        identity = self.directory / "model.json"
        if not identity.exists():
            _write_atomic(identity, orjson.dumps({"model": self.model, "dim": self.embed_dim}))
        path = self.directory / f"part-{number:06d}.npz"
        tmp = path.with_name("tmp-" + path.name)  # outside the part-*.npz glob
        np.savez(tmp, hashes=np.array(hashes, dtype="S64"), vectors=vectors)
        os.replace(tmp, path)

    def _load(self, part: Path) -> None:
        try:
            with np.load(part, allow_pickle=False) as data:
                hashes, vectors = data["hashes"], data["vectors"]
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring cache file %s (%s)", part, e)
            return
        if vectors.ndim != 2 or vectors.shape[1] != self.embed_dim or len(hashes) != len(vectors):
            log.warning("ignoring cache file %s: shape %s", part, vectors.shape)
            return
        for h, row in zip(hashes, vectors.astype(np.float32, copy=False), strict=True):
            self._rows[h.decode()] = row


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:80]


def _part_number(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
