"""`clipserve dedupe PATH...`: its flags, and one run from folders to the report."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from clipserve.dedupe.cache import EmbeddingStore, carried_over, load_manifest, save_manifest
from clipserve.dedupe.embed import Embedder, embed_missing, model_identity
from clipserve.dedupe.group import build_groups, by_hash
from clipserve.dedupe.index import ANN_FROM, near_pairs
from clipserve.dedupe.report import Outcome, counts, write_reports
from clipserve.dedupe.scan import scan
from clipserve.errors import StartupError
from clipserve.logs import configure_logging

log = logging.getLogger("clipserve.dedupe")

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_OUT = "dedupe-report"
# Cosine thresholds for near-duplicates, by model name. Not measured here: this machine has
# no trained weights, and random weights calibrate nothing (bench/dedupe_eval.py measures the
# pipeline only). 0.95 sits in the range published for CLIP ViT-B-32 near-duplicates
# (0.90-0.99): re-encodes, resizes and light crops score above it, different shots of one
# scene mostly below. Lower it to catch heavier edits, raise it for fewer false groups.
THRESHOLDS = {"ViT-B-32": 0.95}
FALLBACK_THRESHOLD = 0.95


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clipserve dedupe",
        description=(
            "Find exact and near-duplicate photos (JPEG, PNG, WebP; HEIC with the heic extra) "
            "under PATHs: exact copies by content hash, near ones by CLIP cosine similarity, "
            "grouped transitively. Writes groups.json, groups.csv and report.html to --out."
        ),
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="folders or files to scan")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--url", type=_url, default=DEFAULT_URL, help=f"a clipserve server [{DEFAULT_URL}]"
    )
    where.add_argument(
        "--local", action="store_true", help="run the model in this process (no server)"
    )
    parser.add_argument("--model", default="ViT-B-32", help="--local: open_clip model or JSON")
    parser.add_argument(
        "--pretrained", default="laion2b_s34b_b79k", help="--local: weights tag [laion2b_s34b_b79k]"
    )
    parser.add_argument("--checkpoint", help="--local: a state dict file instead of --pretrained")
    parser.add_argument("--api-key", help="the server's API key, if it asks for one")
    parser.add_argument(
        "--threshold",
        type=_threshold,
        help="cosine similarity from which two photos are near-duplicates "
        f"[{FALLBACK_THRESHOLD:g} for ViT-B-32; see the README]",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(DEFAULT_OUT), help=f"report folder [{DEFAULT_OUT}]"
    )
    parser.add_argument(
        "--cache", type=Path, help="manifest and embeddings kept between runs [OUT/cache]"
    )
    parser.add_argument(
        "--index",
        choices=("auto", "exact", "ann"),
        default="auto",
        help="exact: compare every pair; ann: a USearch index (the dedupe extra); auto: exact "
        f"below {ANN_FROM} photos, the index from there if installed [auto]",
    )
    parser.add_argument(
        "--batch-size", type=_at_least(1), default=32, help="images per request [32]"
    )
    parser.add_argument(
        "--concurrency", type=_at_least(1), default=4, help="requests in flight [4]"
    )
    parser.add_argument("--timeout", type=_seconds, default=60.0, help="seconds per request [60]")
    parser.add_argument(
        "--retries", type=_at_least(0), default=5, help="retries of a failed request [5]"
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not any(os.path.exists(p) for p in args.paths):  # one missing among others: skipped
        parser.error("no such file or folder: " + ", ".join(args.paths))
    configure_logging(args.log_level)
    from clipserve.client import Client, ClientError

    try:
        with Client(
            None if args.local else args.url,
            mode="local" if args.local else "remote",
            model=args.model,
            pretrained=args.pretrained,
            checkpoint=args.checkpoint,
            api_key=args.api_key,
            batch_size=args.batch_size,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            retries=args.retries,
        ) as client:
            outcome = run(args, client)
    except (ClientError, StartupError, OSError) as e:
        print(f"clipserve dedupe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    c = counts(outcome)
    print(
        f"{c['photos']} photos, {c['groups']} groups ({c['exact_groups']} exact, "
        f"{c['near_groups']} near), {c['duplicates']} extra copies "
        f"({c['exact_copies']} byte-identical), {c['skipped']} skipped, "
        f"{c['embedded']} embedded; report: {args.out / 'report.html'}"
    )
    return 0


def default_threshold(model: str) -> float:
    """The threshold for a model identity ("ViT-B-32/laion2b_s34b_b79k") or name."""
    return THRESHOLDS.get(model.split("/", 1)[0], FALLBACK_THRESHOLD)


def run(args: argparse.Namespace, embedder: Embedder) -> Outcome:
    """Scan, embed what the cache lacks, group, and write the reports."""
    start = time.monotonic()
    cache: Path = args.cache or args.out / "cache"
    known = load_manifest(cache)
    found = scan(args.paths, known)
    log.info(
        "found %d photos (%d files read, the rest known from the manifest), %d skipped, "
        "%d other files ignored",
        len(found.photos),
        found.read,
        len(found.skipped),
        found.ignored,
    )
    kept = carried_over(known, args.paths, (p.path for p in found.photos))
    save_manifest(cache, [*found.photos, *kept])

    photos = by_hash(found.photos)
    model, dim, variant = model_identity(embedder)
    threshold = args.threshold if args.threshold is not None else default_threshold(model)
    store = EmbeddingStore(cache, model, dim, variant)
    sent, failed = embed_missing(embedder, store, photos)
    store.compact()
    # Only embedded hashes are compared; copies of one that is not are still an exact group.
    hashes = [h for h in photos if h in store]
    vectors = store.vectors(hashes)
    pairs = near_pairs(vectors, threshold, args.index)
    groups = build_groups(photos, hashes, vectors, pairs)
    outcome = Outcome(
        model=model,
        threshold=threshold,
        photos=sum(len(c) for c in photos.values()),
        unique=len(photos),
        embedded=sent,
        groups=groups,
        skipped=[*found.skipped, *failed],
    )
    write_reports(outcome, args.out)
    log.info("done in %.1f s: %d images sent to the model", time.monotonic() - start, sent)
    return outcome


def _threshold(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value"
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must start with http:// or https://, got {text}")
    return text
