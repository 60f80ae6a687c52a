"""Pairs over a threshold: blockwise is exact whatever the block; the ANN index agrees with it
on clustered vectors once grouped."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

from bench.dedupe_scale import synthetic
from clipserve.dedupe import index
from clipserve.dedupe.group import components
from clipserve.dedupe.index import min_pairwise, near_pairs, pairs_blockwise, pairs_from_neighbours


def as_set(pairs: index.Pairs) -> set[tuple[int, int]]:
    return set(zip(pairs.left.tolist(), pairs.right.tolist(), strict=True))


def brute_force(x: np.ndarray, threshold: float) -> set[tuple[int, int]]:
    return {
        (i, j)
        for i, j in itertools.combinations(range(len(x)), 2)
        if float(x[i] @ x[j]) >= threshold
    }


@pytest.mark.parametrize("block", [1, 7, 64, 4096])
def test_blockwise_finds_exactly_the_pairs_over_the_threshold(block: int) -> None:
    x, _ = synthetic(300, dim=32, seed=3)
    want = brute_force(x, 0.9)
    assert len(want) > 20  # the planted copies
    pairs = pairs_blockwise(x, 0.9, block=block)
    assert as_set(pairs) == want and len(pairs) == len(want)
    assert np.allclose(pairs.similarity, np.einsum("ij,ij->i", x[pairs.left], x[pairs.right]))


def test_blockwise_with_fewer_than_two_rows_finds_nothing() -> None:
    assert len(pairs_blockwise(np.zeros((0, 8), np.float32), 0.5)) == 0
    assert len(pairs_blockwise(np.ones((1, 8), np.float32) / 8**0.5, 0.5)) == 0


def test_ann_agrees_with_blockwise_on_clustered_vectors() -> None:
    pytest.importorskip("usearch", reason="the dedupe extra (usearch) is not installed")
    x, planted = synthetic(4000, seed=1)
    exact = pairs_blockwise(x, 0.92)
    ann = index.pairs_ann(x, 0.92, threads=1)
    found, want = as_set(ann), as_set(exact)
    assert found <= want  # re-scored exactly: nothing under the threshold
    assert len(found) >= 0.97 * len(want)
    grouped = {tuple(c) for c in components(len(x), ann)}
    assert grouped == {tuple(c) for c in components(len(x), exact)}
    assert len(planted) > 300


def test_auto_is_exact_below_ann_from_and_says_when_the_extra_would_help(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    x, _ = synthetic(500, dim=16, seed=2)
    want = as_set(pairs_blockwise(x, 0.95))
    assert as_set(near_pairs(x, 0.95)) == want
    monkeypatch.setattr(index, "ANN_FROM", 100)
    monkeypatch.setattr(index, "ann_available", lambda: False)
    with caplog.at_level(logging.INFO, "clipserve.dedupe.index"):
        assert as_set(near_pairs(x, 0.95)) == want
    assert "pip install 'clipserve[dedupe]'" in caplog.text
    with pytest.raises(RuntimeError, match=r"clipserve\[dedupe\]"):
        near_pairs(x, 0.95, method="ann")


def test_pairs_from_neighbours_counts_each_pair_once_and_rescores() -> None:
    x = np.eye(4, dtype=np.float32)
    x[1] = x[0]
    neighbours = np.array([[0, 1, -1], [1, 0, 3], [2, 2, 9], [3, 1, 0]])
    pairs = pairs_from_neighbours(x, neighbours, 0.5)
    assert as_set(pairs) == {(0, 1)} and pairs.similarity.tolist() == [1.0]
    assert as_set(pairs_from_neighbours(x, neighbours, -1.0)) == {(0, 1), (0, 3), (1, 3)}


def test_min_pairwise_is_the_loosest_pair() -> None:
    x, _ = synthetic(50, dim=8, seed=4)
    want = min(float(x[i] @ x[j]) for i, j in itertools.combinations(range(50), 2))
    assert min_pairwise(x, block=7) == pytest.approx(want, abs=1e-6)
    assert min_pairwise(x[:1]) == 1.0


def test_identical_vectors_pair_at_threshold_one() -> None:
    """float32 rounds the dot product of a unit vector with itself to 0.99999994 or so:
    --threshold 1 still pairs identical embeddings, exactly and from neighbours."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((200, 512)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    assert (np.einsum("ij,ij->i", rows, rows) < 1.0).any()  # the rounding this is about
    for v in rows:
        x = np.stack([v, v])
        assert as_set(pairs_blockwise(x, 1.0)) == {(0, 1)}
        assert as_set(pairs_from_neighbours(x, np.array([[1], [0]]), 1.0)) == {(0, 1)}
