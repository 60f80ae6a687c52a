"""Embedding what the cache lacks, one file per content hash, through an `Embedder`.

`clipserve.client.Client` is the embedder the command uses (a server with --url, or the model
in this process with --local); the tests pass the real local client, counted.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
from PIL import Image, ImageOps

from clipserve.dedupe.cache import EmbeddingStore
from clipserve.dedupe.scan import HEIF_FORMAT, Photo, Skipped

log = logging.getLogger(__name__)

# Files per call to the embedder: the cache is written after each, so an interrupted run
# loses at most this many embeddings. The client batches and pipelines within a call.
CHUNK = 256
HEIF_JPEG_QUALITY = 95


class Embeddings(Protocol):
    @property
    def vectors(self) -> np.ndarray: ...  # (N, D) float32, NaN rows where an item failed

    @property
    def errors(self) -> Mapping[int, str]: ...  # item index → why it failed


class Embedder(Protocol):
    """What dedupe needs of `clipserve.client.Client`."""

    def embed_images_checked(self, images: Sequence[str | bytes]) -> Embeddings: ...

    def info(self) -> Mapping[str, object]: ...


def model_identity(embedder: Embedder) -> tuple[str, int, str]:
    """The model's identity (its name and weights, the cache's key), embedding size, and how
    the server's preprocessing departs from open_clip's ("" where it does not): a server under
    `--jpeg-scaling fast` crops JPEGs a little differently, so its embeddings are kept apart."""
    info = embedder.info()
    model, dim = info.get("model"), info.get("embed_dim")
    if not isinstance(model, str) or not isinstance(dim, int):
        raise RuntimeError(f"the server's /info has no model identity and embed_dim: {info}")
    variant = "jpeg-scaling-fast" if info.get("jpeg_scaling") == "fast" else ""
    return model, dim, variant


def embed_missing(
    embedder: Embedder, store: EmbeddingStore, photos: Mapping[str, list[Photo]]
) -> tuple[int, list[Skipped]]:
    """Embed the first file of every content hash the store lacks, `CHUNK` at a time; each
    chunk is stored as soon as it is answered. Returns how many files were sent, and the
    files (every copy of a failed hash) skipped with the embedder's reason."""
    todo = store.missing(photos)
    skipped: list[Skipped] = []
    for start in range(0, len(todo), CHUNK):
        hashes, items = [], []
        for h in todo[start : start + CHUNK]:
            try:
                items.append(_item(photos[h][0]))
                hashes.append(h)
            except (OSError, ValueError) as e:
                skipped.extend(_skip(photos[h], f"cannot convert: {e}"))
        if not hashes:
            continue
        result = embedder.embed_images_checked(items)
        vectors = np.asarray(result.vectors, np.float32)
        if vectors.shape != (len(hashes), store.embed_dim):
            raise RuntimeError(
                f"the embedder answered shape {vectors.shape} for {len(hashes)} images"
            )
        good = []
        for i, h in enumerate(hashes):
            if i in result.errors or not np.isfinite(vectors[i]).all():
                reason = _unnamed(result.errors.get(i, "no embedding"), items[i], i)
                skipped.extend(_skip(photos[h], f"embedding failed: {reason}"))
            else:
                good.append(i)
        rows = vectors[good]
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        store.add([hashes[i] for i in good], rows / np.maximum(norms, 1e-12))
        done = min(start + CHUNK, len(todo))
        log.info("embedded %d of %d new images (%d%%)", done, len(todo), _percent(done, todo))
    return len(todo), skipped


def _item(photo: Photo) -> str | bytes:
    """What to send for a photo: its path, or for HEIC/HEIF (which servers do not decode)
    JPEG bytes made here with the pillow-heif plugin, upright."""
    if photo.format != HEIF_FORMAT:
        return photo.path
    with Image.open(photo.path) as img:
        upright = ImageOps.exif_transpose(img).convert("RGB")
    out = io.BytesIO()
    upright.save(out, "JPEG", quality=HEIF_JPEG_QUALITY)
    return out.getvalue()


def _unnamed(reason: str, item: str | bytes, index: int) -> str:
    """The embedder's reason without the name it starts with ("<path>: why", "<bytes #i>: why"):
    every copy of the content is skipped with it, each under its own path."""
    source = item if isinstance(item, str) else f"<bytes #{index}>"
    return reason.removeprefix(f"{source}: ")


def _skip(copies: list[Photo], reason: str) -> list[Skipped]:
    for p in copies:
        log.warning("skipped %s: %s", p.path, reason)
    return [Skipped(p.path, reason) for p in copies]


def _percent(done: int, todo: Sequence[str]) -> int:
    return math.floor(100 * done / len(todo)) if todo else 100
