"""Exact groups by content hash, near groups as connected components, and what each group's
similarity says."""

from __future__ import annotations

import math

import numpy as np

from clipserve.dedupe.group import UnionFind, build_groups, by_hash, components
from clipserve.dedupe.index import Pairs, pairs_blockwise
from clipserve.dedupe.report import Outcome, counts
from clipserve.dedupe.scan import Photo


def photo(path: str, sha: str, pixels: int = 100, size: int = 1000) -> Photo:
    return Photo(path, size, 0, sha, pixels, 1, "JPEG")


def unit_at(degrees: float) -> np.ndarray:
    r = math.radians(degrees)
    return np.array([math.cos(r), math.sin(r), 0.0], np.float32)


def test_union_find_joins_transitively() -> None:
    sets = UnionFind(6)
    sets.union(0, 1)
    sets.union(4, 1)
    sets.union(2, 5)
    assert sets.components() == [[0, 1, 4], [2, 5], [3]]
    assert sets.find(4) == sets.find(0) != sets.find(2)


def test_components_of_a_chain_are_one() -> None:
    pairs = Pairs(np.array([0, 1, 2, 5]), np.array([1, 2, 3, 6]), np.ones(4, np.float32))
    assert components(8, pairs) == [[0, 1, 2, 3], [5, 6]]


def test_exact_copies_group_by_hash_without_any_pair() -> None:
    photos = by_hash([photo("/a.jpg", "h1"), photo("/b.jpg", "h2"), photo("/c.jpg", "h1")])
    assert {h: [p.path for p in ps] for h, ps in photos.items()} == {
        "h1": ["/a.jpg", "/c.jpg"],
        "h2": ["/b.jpg"],
    }
    vectors = np.stack([unit_at(0), unit_at(90)])
    empty = Pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    (group,) = build_groups(photos, ["h1", "h2"], vectors, empty)
    assert group.kind == "exact" and group.similarity == 1.0
    assert [(m.photo.path, m.similarity) for m in group.members] == [
        ("/a.jpg", 1.0),
        ("/c.jpg", 1.0),
    ]


def test_a_chain_is_one_group_whose_similarity_is_its_loosest_pair() -> None:
    """A~B and B~C at 20 degrees apart, A and C at 40 (cos 0.766, under the threshold): one
    group; its similarity is the minimum over all pairs, each file's is to the first file."""
    hashes = ["a", "b", "c", "far"]
    vectors = np.stack([unit_at(0), unit_at(20), unit_at(40), unit_at(90)])
    photos = by_hash(
        [
            photo("/a.jpg", "a", pixels=50),
            photo("/b.jpg", "b", pixels=400),  # the most pixels: shown first, keep
            photo("/c.jpg", "c", pixels=50, size=2000),
            photo("/c-copy.jpg", "c", pixels=50),
            photo("/far.jpg", "far"),
        ]
    )
    pairs = pairs_blockwise(vectors, 0.9)
    assert sorted(zip(pairs.left.tolist(), pairs.right.tolist(), strict=True)) == [(0, 1), (1, 2)]

    (group,) = build_groups(photos, hashes, vectors, pairs)
    assert group.kind == "near"
    assert group.similarity == round(math.cos(math.radians(40)), 6)
    got = [(m.photo.path, m.similarity) for m in group.members]
    cos20 = round(math.cos(math.radians(20)), 6)
    # Pixels, then bytes, then path decide the order after the first.
    assert got == [("/b.jpg", 1.0), ("/c.jpg", cos20), ("/a.jpg", cos20), ("/c-copy.jpg", cos20)]
    # A near group's byte-identical copy says so: it needs no review to delete.
    assert group.copy_of() == [None, None, None, "/c.jpg"]
    assert group.exact_copies == 1
    outcome = Outcome("m", 0.9, 5, 4, 4, [group], [])
    assert {k: counts(outcome)[k] for k in ("duplicates", "exact_copies", "near_copies")} == {
        "duplicates": 3,
        "exact_copies": 1,
        "near_copies": 2,
    }


def test_groups_come_largest_first_and_single_files_are_not_groups() -> None:
    hashes = ["x", "y", "z", "w", "v"]
    vectors = np.stack([unit_at(0), unit_at(1), unit_at(2), unit_at(90), unit_at(91)])
    photos = by_hash(photo(f"/{h}.jpg", h) for h in hashes)
    groups = build_groups(photos, hashes, vectors, pairs_blockwise(vectors, 0.99))
    assert [[m.photo.path for m in g.members] for g in groups] == [
        ["/x.jpg", "/y.jpg", "/z.jpg"],
        ["/v.jpg", "/w.jpg"],
    ]
    lonely = build_groups(photos, hashes, vectors, pairs_blockwise(vectors, 0.99999))
    assert lonely == []
