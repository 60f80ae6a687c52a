"""Pairs of embeddings at cosine similarity >= a threshold: exact blockwise products, or an
approximate nearest-neighbour index (USearch, the `dedupe` extra) for large sets.

Both take L2-normalised float32 rows, so the cosine is the dot product. Blockwise compares
every pair in row x column blocks (memory bounded by the block, not by n²). The ANN path asks
each row for its ANN_NEIGHBOURS nearest rows and keeps those over the threshold, re-scored
exactly: it can miss a pair (bench/results/dedupe-scale.json measures how often), but once
grouped, a missed pair inside a group is usually joined through the group's other members.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

log = logging.getLogger(__name__)

Method = Literal["auto", "exact", "ann"]
BLOCK = 4096  # rows per block: a 4096 x 4096 float32 block of products is 64 MiB
# bench/results/dedupe-scale.json (2 shared Xeon cores, 512-d): blockwise finds every pair of
# 100k rows in 24-38 s and of 200k in 95 s, growing as n²; USearch took 21-31 s and 55 s
# there, missing 0.03% and 0.2% of the pairs. Exact below, the index from here on.
ANN_FROM = 200_000
ANN_NEIGHBOURS = 16
ANN_CONNECTIVITY = 16
ANN_EXPANSION_ADD = 64
ANN_EXPANSION_SEARCH = 64
EXTRA = "pip install 'clipserve[dedupe]'"
# Pairs are kept from threshold - EPSILON: float32 rounding puts the dot product of two identical
# unit vectors at 0.99999994 or so, which --threshold 1 would otherwise miss.
EPSILON = 1e-6


@dataclass(frozen=True)
class Pairs:
    """Index pairs (left < right) and their cosine similarity, one entry per pair."""

    left: np.ndarray  # int64
    right: np.ndarray  # int64
    similarity: np.ndarray  # float32

    def __len__(self) -> int:
        return len(self.left)


def ann_available() -> bool:
    try:
        import usearch.index  # noqa: F401
    except ImportError:
        return False
    return True


def near_pairs(x: np.ndarray, threshold: float, method: Method = "auto", threads: int = 0) -> Pairs:
    """Every pair of rows of `x` at cosine >= `threshold` ("exact"), or those an ANN index
    finds ("ann"); "auto" is exact below ANN_FROM rows, the index above when installed."""
    if method == "auto":
        method = "ann" if len(x) >= ANN_FROM and ann_available() else "exact"
        if len(x) >= ANN_FROM and method == "exact":
            log.info(
                "%d embeddings: comparing every pair (exact, about n² work); an ANN index "
                "would be faster past %d: %s",
                len(x),
                ANN_FROM,
                EXTRA,
            )
    if method == "ann":
        if not ann_available():
            raise RuntimeError(f"--index ann needs the usearch package: {EXTRA}")
        return pairs_ann(x, threshold, threads=threads)
    return pairs_blockwise(x, threshold)


def pairs_blockwise(x: np.ndarray, threshold: float, block: int = BLOCK) -> Pairs:
    """All pairs over the threshold, exactly: blocks of the upper triangle of x @ x.T."""
    x = np.ascontiguousarray(x, np.float32)
    n = len(x)
    buffer = np.empty((min(block, n), min(block, n)), np.float32)
    lefts, rights, sims = [], [], []
    for i0 in range(0, n, block):
        rows = x[i0 : i0 + block]
        for j0 in range(i0, n, block):
            cols = x[j0 : j0 + block]
            products = np.matmul(rows, cols.T, out=buffer[: len(rows), : len(cols)])
            i, j = np.nonzero(products >= threshold - EPSILON)
            if i0 == j0:  # the diagonal block: each pair once, no row with itself
                keep = j > i
                i, j = i[keep], j[keep]
            lefts.append(i + i0)
            rights.append(j + j0)
            sims.append(products[i, j])
    return _pairs(lefts, rights, sims)


def pairs_from_neighbours(x: np.ndarray, neighbours: np.ndarray, threshold: float) -> Pairs:
    """Pairs from a (n, k) table of neighbour ids (-1 or out of range: none), re-scored
    exactly, each pair once, kept where the cosine is >= `threshold`."""
    n, k = neighbours.shape
    left = np.repeat(np.arange(n, dtype=np.int64), k)
    right = neighbours.reshape(-1).astype(np.int64)
    ok = (right >= 0) & (right < n) & (right != left)
    left, right = left[ok], right[ok]
    left, right = np.minimum(left, right), np.maximum(left, right)
    key = np.unique(left * n + right)
    left, right = key // n, key % n
    sims = np.einsum("ij,ij->i", x[left], x[right]) if len(key) else np.zeros(0, np.float32)
    keep = sims >= threshold - EPSILON
    return Pairs(left[keep], right[keep], sims[keep].astype(np.float32))


def pairs_ann(x: np.ndarray, threshold: float, threads: int = 0) -> Pairs:
    """Pairs over the threshold among each row's ANN_NEIGHBOURS nearest (USearch HNSW, int8
    quantised inner product: the closest shortlist is re-scored exactly)."""
    from usearch.index import BatchMatches, Index

    x = np.ascontiguousarray(x, np.float32)
    if len(x) < 2:
        return pairs_blockwise(x, threshold)
    index = Index(
        ndim=x.shape[1],
        metric="ip",
        dtype="i8",
        connectivity=ANN_CONNECTIVITY,
        expansion_add=ANN_EXPANSION_ADD,
        expansion_search=ANN_EXPANSION_SEARCH,
    )
    index.add(np.arange(len(x), dtype=np.uint64), x, threads=threads)
    found = index.search(x, min(ANN_NEIGHBOURS + 1, len(x)), threads=threads)
    assert isinstance(found, BatchMatches)  # a 2-d query answers one row per vector
    keys = np.asarray(found.keys, dtype=np.int64).reshape(len(x), -1)
    counts = np.asarray(found.counts).reshape(-1)
    keys[np.arange(keys.shape[1])[None, :] >= counts[:, None]] = -1  # slots with no result
    return pairs_from_neighbours(x, keys, threshold)


def min_pairwise(x: np.ndarray, block: int = BLOCK) -> float:
    """The smallest cosine between two rows (1.0 for fewer than two), in blocks."""
    if len(x) < 2:
        return 1.0
    lowest = 1.0
    for i0 in range(0, len(x), block):
        products = x[i0 : i0 + block] @ x.T
        lowest = min(lowest, float(products.min()))
    return min(lowest, 1.0)


def _pairs(lefts: list[np.ndarray], rights: list[np.ndarray], sims: list[np.ndarray]) -> Pairs:
    if not lefts:
        return Pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    return Pairs(
        np.concatenate(lefts).astype(np.int64),
        np.concatenate(rights).astype(np.int64),
        np.concatenate(sims).astype(np.float32),
    )
