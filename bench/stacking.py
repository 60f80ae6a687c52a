"""Stacking a batch of 224x224 RGB images: one `np.stack` against `clipserve.backends.stacking`'s
chunks on a few threads, in interleaved rounds.

Two uses, as the engine has them: `into` copies into one reused buffer (a launch filling its
pinned staging slot), `fresh` allocates the batch each time (the synchronous path's
`compute`). Reported per batch size: milliseconds a batch (median, min, max over rounds, each
round's figure the median of its repeats) and the ratio of the two in each round.

    python -m bench.stacking --out bench/results/stacking-<date>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.common import machine, rotated, spread, timed, utc_now, write_report
from clipserve.backends.stacking import stack, stack_into, threads_for
from clipserve.config import resolve_workers

SHAPE = (224, 224, 3)


def variants(arrays: list[np.ndarray]) -> dict[str, Callable[[], object]]:
    out = np.empty((len(arrays), *SHAPE), np.uint8)
    return {
        "into-np.stack": lambda: np.stack(arrays, out=out),
        "into-chunked": lambda: stack_into(arrays, out),
        "fresh-np.stack": lambda: np.stack(arrays),
        "fresh-chunked": lambda: stack(arrays),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="16,64,256")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    report: dict[str, object] = {
        "benchmark": "stacking",
        "time": utc_now(),
        "machine": machine(),
        "usable_cores": resolve_workers(0),
        "rounds": args.rounds,
        "repeat": args.repeat,
        "sizes": {},
    }
    for n in (int(s) for s in args.sizes.split(",")):
        arrays = [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(n)]
        runs = variants(arrays)
        for fn in runs.values():  # warm: the pool's threads, the buffers' pages
            fn()
        ms: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for name in rotated(list(runs), r):
                ms[name].append(statistics.median(timed(runs[name], args.repeat)) * 1e3)
        ratios = {
            use: spread(
                [a / b for a, b in zip(ms[f"{use}-np.stack"], ms[f"{use}-chunked"], strict=True)],
                2,
            )
            for use in ("into", "fresh")
        }
        report["sizes"][str(n)] = {  # type: ignore[index]
            "megabytes": round(n * int(np.prod(SHAPE)) / 1e6, 1),
            "threads": threads_for(n * int(np.prod(SHAPE)), resolve_workers(0)),
            "ms": {name: spread(values, 3) for name, values in ms.items()},
            "np_stack_over_chunked": ratios,
        }
    report["cpu_count"] = os.cpu_count()
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
