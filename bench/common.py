"""What every benchmark script shares: the model flags, how the machine is named, CLIP's
preprocessing, timing and how a series of measurements is summarised."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from clipserve.inference.preprocess import PreprocessSpec
from clipserve.loadgen.procs import machine as bench_machine

T = TypeVar("T")

# The repository root: the working directory of the servers and tools the benchmarks start.
REPO = Path(__file__).resolve().parent.parent

# OpenAI CLIP's 224x224 crop and normalisation, as ViT-B-32 uses them.
CLIP_SPEC = PreprocessSpec(
    (224, 224), (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--pretrained", default="none", help="none = random weights")
    parser.add_argument("--checkpoint")
    parser.add_argument("--gpus", default="cpu")


def model_flags(args: argparse.Namespace) -> dict[str, str]:
    flags = {"model": args.model, "pretrained": args.pretrained, "gpus": args.gpus}
    if args.checkpoint:
        flags["checkpoint"] = args.checkpoint
    return flags


def describe_model(args: argparse.Namespace) -> str:
    return f"{args.model} ({args.checkpoint or args.pretrained})"


def machine() -> str:
    """The CPU model, cores and GPU models, as clipserve-bench names the machine."""
    m = bench_machine()
    gpus = ", ".join(m["gpus"]) or "no GPU"  # type: ignore[arg-type]
    return f"{m['cpu']}, {m['cores']} cores, {gpus}, {platform.system()}"


def write_report(report: dict[str, object], out: Path | None) -> None:
    """Print a benchmark's JSON, and write it to `out` if given (bench/results/...)."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds per call of `fn`, `repeat` calls."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def spread(values: Sequence[float], digits: int) -> dict[str, float]:
    """The median of repeated measurements with their min and max, rounded to `digits`."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def rotated(items: Sequence[T], by: int) -> list[T]:
    """Each round starts with a different variant: drift on a shared machine spreads evenly."""
    k = by % len(items) if items else 0
    return [*items[k:], *items[:k]]


def say(msg: str) -> None:
    """A progress line on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def per_request(
    count: Callable[[int], int], requests: int, served: Callable[[int], float]
) -> float:
    """A count per request from runs of `requests` and 4x as many (callgrind's instructions,
    say), their difference over the requests between them, so start-up cancels out. `count(n)`
    runs n; `served(n)` is how many requests such a run counts."""
    small, large = count(requests), count(4 * requests)
    return (large - small) / (served(4 * requests) - served(requests))
