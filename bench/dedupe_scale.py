"""How `clipserve dedupe` finds close pairs at scale: exact blockwise products against ANN
indexes (USearch and FAISS, HNSW each, 32-bit and 8-bit), on synthetic CLIP-like embeddings.

    python -m bench.dedupe_scale [--sizes 25000 100000] [--rounds 3] [--quick]
    python -m bench.dedupe_scale --sizes 200000 --methods blockwise usearch-i8 faiss-hnsw-sq8 \\
        --append

The vectors (512-d, L2-normalised) are clustered like a photo library: topics of related
photos (cosine 0.4-0.8 between members, so many neighbours are close but not duplicates) and
planted near-duplicate groups: 1-3 copies of a photo, each at a known cosine in [0.93, 0.995]
to it. Pairs are searched at cosine >= 0.92. For each size, in interleaved rounds (each round
starts with a different method), every method's build and query seconds (medians, min, max)
and its recall: of the exact pairs, and of the planted pairs once grouped (union-find) — a
pair missed by the index still counts as found if its two files end up in one group, as the
report would show them. ANN pairs are re-scored exactly, so none is false. Writes
bench/results/dedupe-scale.json (or --out); --quick: 20k vectors, one round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.common import REPO, machine, rotated, say, spread, utc_now
from clipserve.dedupe import index
from clipserve.dedupe.group import build_groups
from clipserve.dedupe.index import Pairs, pairs_blockwise, pairs_from_neighbours
from clipserve.dedupe.scan import Photo

DIM = 512
THRESHOLD = 0.92
PHOTOS_PER_TOPIC = 50
PLANTED_SHARE = 0.05  # of the vectors, bases of a planted group
THREADS = os.cpu_count() or 1


def unit(a: np.ndarray) -> np.ndarray:
    out: np.ndarray = (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)
    return out


def synthetic(n: int, dim: int = DIM, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n, dim) unit vectors and the planted (base, copy) pairs, shape (m, 2)."""
    rng = np.random.default_rng(seed)
    topics = unit(rng.standard_normal((max(n // PHOTOS_PER_TOPIC, 1), dim)))
    topic = rng.integers(0, len(topics), n)
    share = rng.uniform(0.4, 0.8, len(topics))[topic][:, None]
    x = unit(
        np.sqrt(share) * topics[topic] + np.sqrt(1 - share) * unit(rng.standard_normal((n, dim)))
    )
    order = rng.permutation(n)
    bases = order[: int(n * PLANTED_SHARE)]
    free = iter(order[len(bases) :])
    planted = []
    for base in bases:
        for _ in range(rng.integers(1, 4)):
            copy = next(free, None)
            if copy is None:
                break
            u = rng.standard_normal(dim).astype(np.float32)
            u -= (u @ x[base]) * x[base]
            s = rng.uniform(0.93, 0.995)
            x[copy] = s * x[base] + np.sqrt(1 - s * s) * u / np.linalg.norm(u)
            planted.append((base, copy))
    return unit(x), np.array(planted, np.int64).reshape(-1, 2)


def _faiss(quantised: bool) -> Callable[[np.ndarray], Pairs]:
    def run(x: np.ndarray) -> Pairs:
        import faiss

        faiss.omp_set_num_threads(THREADS)
        ip = faiss.METRIC_INNER_PRODUCT
        idx: faiss.IndexHNSW
        if quantised:
            qt_8bit = faiss.ScalarQuantizer.QT_8bit  # an enum int; the stubs want the class
            idx = faiss.IndexHNSWSQ(x.shape[1], qt_8bit, 16, ip)  # type: ignore[arg-type]
            idx.train(x)
        else:
            idx = faiss.IndexHNSWFlat(x.shape[1], 16, ip)
        idx.hnsw.efConstruction = index.ANN_EXPANSION_ADD
        idx.add(x)
        idx.hnsw.efSearch = index.ANN_EXPANSION_SEARCH
        _, neighbours = idx.search(x, index.ANN_NEIGHBOURS + 1)
        return pairs_from_neighbours(x, neighbours, THRESHOLD)

    return run


def _usearch(dtype: str) -> Callable[[np.ndarray], Pairs]:
    def run(x: np.ndarray) -> Pairs:
        from usearch.index import BatchMatches, Index

        idx = Index(
            ndim=x.shape[1],
            metric="ip",
            dtype=dtype,
            connectivity=index.ANN_CONNECTIVITY,
            expansion_add=index.ANN_EXPANSION_ADD,
            expansion_search=index.ANN_EXPANSION_SEARCH,
        )
        idx.add(np.arange(len(x), dtype=np.uint64), x, threads=THREADS)
        found = idx.search(x, index.ANN_NEIGHBOURS + 1, threads=THREADS)
        assert isinstance(found, BatchMatches)
        keys = np.asarray(found.keys, np.int64)
        keys[np.arange(keys.shape[1])[None, :] >= np.asarray(found.counts)[:, None]] = -1
        return pairs_from_neighbours(x, keys, THRESHOLD)

    return run


METHODS: dict[str, Callable[[np.ndarray], Pairs]] = {
    "blockwise": lambda x: pairs_blockwise(x, THRESHOLD),
    "usearch-i8": lambda x: index.pairs_ann(x, THRESHOLD, threads=THREADS),  # clipserve's
    "usearch-f32": _usearch("f32"),
    "faiss-hnsw-f32": _faiss(quantised=False),
    "faiss-hnsw-sq8": _faiss(quantised=True),
}


def _keys(p: Pairs, n: int) -> np.ndarray:
    return np.unique(p.left * n + p.right)


def _grouped(photos: dict[str, list[Photo]], x: np.ndarray, p: Pairs) -> np.ndarray:
    """What the command does with the pairs (build_groups), as a group id per row (-1-row
    for a row in no group)."""
    hashes = list(photos)
    ids = -1 - np.arange(len(x))
    for number, group in enumerate(build_groups(photos, hashes, x, p)):
        ids[[int(m.photo.sha256) for m in group.members]] = number
    return ids


def measure(n: int, rounds: int, methods: Sequence[str], seed: int = 0) -> dict[str, object]:
    x, planted = synthetic(n, seed=seed)
    photos = {str(i): [Photo(f"/{i}.jpg", 1, 0, str(i), 1, 1, "JPEG")] for i in range(n)}
    say(f"{n} vectors, {len(planted)} planted pairs")
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    group_seconds: dict[str, list[float]] = {m: [] for m in methods}
    runs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {m: [] for m in methods}
    for r in range(rounds):
        for name in rotated(list(methods), r):
            t0 = time.perf_counter()
            pairs = METHODS[name](x)
            t1 = time.perf_counter()
            roots = _grouped(photos, x, pairs)
            t2 = time.perf_counter()
            seconds[name].append(t1 - t0)
            group_seconds[name].append(t2 - t1)
            runs[name].append((_keys(pairs, n), roots))
            say(f"  n={n} round {r + 1} {name}: {t1 - t0:.2f} s pairs + {t2 - t1:.2f} s groups")
    # The exact pairs: blockwise's own answer when it ran (it is exact every time).
    exact = (
        runs["blockwise"][0][0] if "blockwise" in runs else _keys(pairs_blockwise(x, THRESHOLD), n)
    )
    pair_recall = {
        m: [len(np.intersect1d(k, exact)) / max(len(exact), 1) for k, _ in runs[m]] for m in methods
    }
    planted_recall = {
        m: [float((roots[planted[:, 0]] == roots[planted[:, 1]]).mean()) for _, roots in runs[m]]
        for m in methods
    }
    return {
        name: {
            "pairs_s": spread(seconds[name], 3),
            "groups_s": spread(group_seconds[name], 3),
            "total_s": spread(
                [a + b for a, b in zip(seconds[name], group_seconds[name], strict=True)], 3
            ),
            "pair_recall": spread(pair_recall[name], 4),
            "planted_recall": spread(planted_recall[name], 4),
        }
        for name in methods
    } | {"_data": {"exact_pairs": len(exact), "planted_pairs": len(planted)}}


def available(methods: Sequence[str]) -> list[str]:
    out = []
    for name in methods:
        module = "faiss" if name.startswith("faiss") else "usearch" if "usearch" in name else None
        try:
            if module:
                __import__(module)
            out.append(name)
        except ImportError:
            say(f"skipping {name}: {module} is not installed")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[25_000, 100_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--quick", action="store_true", help="20k vectors, one round")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/dedupe-scale.json")
    parser.add_argument(
        "--append", action="store_true", help="add these sizes to --out's (other methods)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds = [20_000], 1
    methods = available(args.methods)
    results = {str(n): measure(n, args.rounds, methods) for n in args.sizes}
    if args.append and args.out.exists():
        results = json.loads(args.out.read_text())["sizes"] | results
    out = {
        "benchmark": "dedupe-scale",
        "date": utc_now(),
        "machine": machine(),
        "python": platform.python_version(),
        "threads": THREADS,
        "dim": DIM,
        "threshold": THRESHOLD,
        "rounds": args.rounds,
        "ann_settings": {
            "neighbours": index.ANN_NEIGHBOURS,
            "connectivity (HNSW M)": index.ANN_CONNECTIVITY,
            "expansion_add (efConstruction)": index.ANN_EXPANSION_ADD,
            "expansion_search (efSearch)": index.ANN_EXPANSION_SEARCH,
        },
        "note": (
            "pairs_s: seconds to find the pairs (index build and query for ANN); groups_s: "
            "build_groups on them (union-find, ordering, similarities), as the command runs it; "
            "pair_recall: share of the exact pairs found; planted_recall: share of the planted "
            "(photo, copy) pairs in one group. Medians with min and max."
        ),
        "sizes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
