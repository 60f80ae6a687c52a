"""Groups of duplicates: files with the same content hash (exact), joined with files whose
embeddings are close (near), as connected components of the pairs over the threshold.

Components are transitive (single linkage): if A~B and B~C, A, B and C are one group even when
A and C are further apart than the threshold. Each group says how far apart it can be:

- `similarity` of a group: the minimum cosine over all pairs of its files (1.0 for an exact
  group), so a reviewer sees the loosest link;
- `similarity` of a file: its cosine to the group's first file, the suggested one to keep
  (the most pixels, then the most bytes, then a real file before a symlink, then the path).

A content hash without an embedding (the model could not take it) is in no near group, but its
copies are still an exact group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from clipserve.dedupe.index import Pairs, min_pairwise
from clipserve.dedupe.scan import Photo


class UnionFind:
    """Disjoint sets over 0..n-1 (path halving, union by size)."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))
        self.size = [1] * n

    def find(self, a: int) -> int:
        parent = self.parent
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]

    def components(self) -> list[list[int]]:
        """Every set, each in ascending order, ordered by its smallest member."""
        sets: dict[int, list[int]] = defaultdict(list)
        for a in range(len(self.parent)):
            sets[self.find(a)].append(a)
        return sorted(sets.values(), key=lambda s: s[0])


@dataclass(frozen=True)
class Member:
    photo: Photo
    similarity: float  # cosine to the group's first file


@dataclass(frozen=True)
class Group:
    members: list[Member]
    similarity: float  # the minimum pairwise cosine within the group
    kind: Literal["exact", "near"]  # exact: one content hash for every file

    def copy_of(self) -> list[str | None]:
        """Per member: the path of the earlier member with the same bytes, or None. A near
        group may hold exact copies too; those need no review to delete."""
        first: dict[str, str] = {}
        found: list[str | None] = []
        for m in self.members:
            path = first.setdefault(m.photo.sha256, m.photo.path)
            found.append(None if path == m.photo.path else path)
        return found

    @property
    def exact_copies(self) -> int:
        """Members whose bytes an earlier member has."""
        return len(self.members) - len({m.photo.sha256 for m in self.members})


def by_hash(photos: Iterable[Photo]) -> dict[str, list[Photo]]:
    """Photos by content hash, in the order seen: one embedding serves each hash."""
    found: dict[str, list[Photo]] = defaultdict(list)
    for p in photos:
        found[p.sha256].append(p)
    return dict(found)


def components(n: int, pairs: Pairs) -> list[list[int]]:
    """Connected components of more than one of 0..n-1 joined by `pairs`."""
    sets = UnionFind(n)
    for a, b in zip(pairs.left.tolist(), pairs.right.tolist(), strict=True):
        sets.union(a, b)
    return [c for c in sets.components() if len(c) > 1]


def build_groups(
    photos: dict[str, list[Photo]], hashes: Sequence[str], vectors: np.ndarray, pairs: Pairs
) -> list[Group]:
    """Groups of two or more files. `hashes[i]` is the content hash of row i of `vectors`
    (L2-normalised), `pairs` index those rows; a hash with several files is a group already,
    with or without a row."""
    sets = UnionFind(len(hashes))
    for a, b in zip(pairs.left.tolist(), pairs.right.tolist(), strict=True):
        sets.union(a, b)
    groups = []
    for rows in sets.components():
        files = [(p, row) for row in rows for p in photos[hashes[row]]]
        if len(files) < 2:
            continue
        files.sort(key=lambda f: _keep_order(f[0]))
        first = vectors[files[0][1]]
        members = [
            Member(p, 1.0 if hashes[row] == hashes[files[0][1]] else _cos(vectors[row], first))
            for p, row in files
        ]
        exact = len(rows) == 1
        similarity = 1.0 if exact else round(min_pairwise(vectors[rows]), 6)
        groups.append(Group(members, similarity, "exact" if exact else "near"))
    embedded = set(hashes)
    for h, copies in photos.items():
        if h not in embedded and len(copies) > 1:
            ordered = sorted(copies, key=_keep_order)
            groups.append(Group([Member(p, 1.0) for p in ordered], 1.0, "exact"))
    groups.sort(key=lambda g: (-len(g.members), g.members[0].photo.path))
    return groups


def _keep_order(p: Photo) -> tuple[int, int, bool, str]:
    """The suggested keep first: a symlink after the file it may point to, so the report never
    suggests deleting the only real copy."""
    return (-p.width * p.height, -p.size, p.link, p.path)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return round(min(float(a @ b), 1.0), 6)
