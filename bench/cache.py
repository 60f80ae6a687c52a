"""The embedding cache under a load with repeated images: served img/s with and without it.

Two servers (the tiny model's shapes, the fake executor sleeping `--per-item-ms` per image, as
a device would spend) differ only in --cache-mb (256 vs 0). Each round sends the same stream
of JPEGs to both, in rotated order, closed loop at `--concurrency`: a share `--repeat` of the
requests repeat an image sent earlier in the stream, the rest are new (each round's images are
new to both servers, so every round starts cold). Reported per variant: the median img/s over
rounds with its min and max, and the cache's counters after the last round.

    python -m bench.cache --out bench/results/cache-<machine>.json   # 5 rounds, ~2 minutes
    python -m bench.cache --quick                                    # 2 short rounds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import machine, rotated, say, spread, utc_now
from bench.metrics import scrape, total
from clipserve.loadgen.images import jpeg
from clipserve.loadgen.procs import clipserve_server, tiny_model

VARIANTS = {"cache": "256", "no-cache": "0"}


def stream(n: int, repeat: float, round_: int) -> list[bytes]:
    """n JPEGs: with probability `repeat` one sent earlier in the stream, else a new one."""
    rng = random.Random(round_)
    sent: list[bytes] = []
    out: list[bytes] = []
    for i in range(n):
        if sent and rng.random() < repeat:
            out.append(rng.choice(sent))
        else:
            image = jpeg(256, 256, seed=round_ * 1_000_000 + i)
            sent.append(image)
            out.append(image)
    return out


async def load(url: str, images: list[bytes], concurrency: int) -> float:
    """Images per second, closed loop; every answer must be a 200."""
    queue = iter(images)
    headers = {"Content-Type": "image/jpeg"}

    async def client(session: aiohttp.ClientSession) -> None:
        for image in queue:
            async with session.post(url + "/embed", data=image, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status

    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return len(images) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--repeat", type=float, default=0.3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--per-item-ms", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 2, 200
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = tiny_model(Path(tmp))
        common = ["--model", str(model), "--pretrained", "none", "--gpus", "cpu"]
        common += ["--backend", "fake", "--backend-option", f"per_item_ms={args.per_item_ms:g}"]
        common += ["--backend-option", "compute=0", "--log-level", "warning"]
        urls = {
            name: stack.enter_context(clipserve_server([*common, "--cache-mb", mb]))
            for name, mb in VARIANTS.items()
        }
        rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(args.rounds):
            images = stream(args.requests, args.repeat, r)
            for name in rotated(list(VARIANTS), r):
                rate = asyncio.run(load(urls[name], images, args.concurrency))
                rates[name].append(rate)
                say(f"round {r + 1}/{args.rounds} {name}: {rate:.1f} img/s")
        counters = {
            name: {
                metric: total(scrape(url), f"clipserve_cache_{metric}_total")
                for metric in ("hits", "misses", "merged", "evictions")
            }
            | {"items_computed": total(scrape(url), "clipserve_items_total")}
            for name, url in urls.items()
        }
    result: dict[str, Any] = {
        "benchmark": "bench.cache",
        "when": utc_now(),
        "machine": machine(),
        "settings": {
            k: getattr(args, k)
            for k in ("rounds", "requests", "repeat", "concurrency", "per_item_ms")
        },
        "img_per_s": {name: spread(values, 1) for name, values in rates.items()},
        "rounds": rates,
        "speedup_median": round(
            spread(rates["cache"], 3)["median"] / spread(rates["no-cache"], 3)["median"], 2
        ),
        "counters": counters,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
