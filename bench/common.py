"""What every benchmark script shares: the model flags and how the machine is named."""

from __future__ import annotations

import argparse
import platform
import time

from clipserve.loadgen.procs import machine as bench_machine


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


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
