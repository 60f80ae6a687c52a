"""The embedding cache's keys, and a request's items as the cache leaves them.

A key is a digest of everything that makes two answers differ: the served model (name,
weights digest, precision, backend and its options, how images are decoded and preprocessed),
the tower, whether the row is L2-normalised, and the item itself: an image's encoded bytes as
sent (not its pixels: a hit costs no decoding), a tensor row's dtype, shape and bytes, a text's
token ids (so texts that tokenise alike share an entry). SHA-256, truncated to 128 bits: a
cryptographic hash, because a crafted collision would hand one client's embedding to another;
with SHA-NI it hashes 1.2 GB/s here, ~0.1 ms for a 100 KB JPEG. Made by the front end (in the
pool), held by the engine (`batching/cache.py`).
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from clipserve.batching.tower import Completed, TowerKind
from clipserve.config import ServerConfig
from clipserve.errors import ClipserveError, with_item_index
from clipserve.http.work import ImageWork
from clipserve.inference.model import LoadedModel

KEY_BYTES = 16
_ITEM = re.compile(r"item (\d+): ")  # with_item_index's prefix


def reads_cache(values: Iterable[str]) -> bool:
    """False when the request says `Cache-Control: no-cache`: compute every item anew.
    `values`: each Cache-Control line (or gRPC metadata entry); lines make one list."""
    return not any(
        part.strip().lower() == "no-cache" for value in values for part in value.split(",")
    )


@dataclass(frozen=True)
class CacheKeys:
    """Keys for one served model; `namespace` digests the model and how it is served."""

    namespace: bytes

    @classmethod
    def of(
        cls, config: ServerConfig, model: LoadedModel, backend: str, precision: str
    ) -> CacheKeys:
        b = config.backend
        served = [model.identity, precision, backend, *b.backend_option, b.decode]
        served.append(repr(model.preprocess))
        return cls(hashlib.sha256("\0".join(served).encode()).digest())

    def _key(
        self, tower: TowerKind, normalize: bool, kind: bytes, data: bytes | memoryview
    ) -> bytes:
        h = hashlib.sha256(self.namespace)
        h.update(b"%s\0%d\0%s\0" % (tower.encode(), normalize, kind))
        h.update(data)
        return h.digest()[:KEY_BYTES]

    def images(self, work: ImageWork, normalize: bool) -> list[bytes]:
        """CPU work for a large request (it reads every byte): run it in the pool."""
        if work.tensor is None:
            return [self._key("image", normalize, b"encoded", data) for data in work.images]
        kind = b"%s%r" % (work.tensor.dtype.str.encode(), work.tensor.shape[1:])
        return [
            self._key("image", normalize, kind, np.ascontiguousarray(row).data)
            for row in work.tensor
        ]

    def texts(self, tokens: np.ndarray, normalize: bool) -> list[bytes]:
        kind = tokens.dtype.str.encode()
        return [
            self._key("text", normalize, kind, np.ascontiguousarray(row).data) for row in tokens
        ]


@dataclass
class Found:
    """A request's items after the cache lookup: the rows found, and the keys of the rest,
    which are decoded and computed (`missing`)."""

    rows: list[np.ndarray | None]
    keys: Sequence[bytes]

    @property
    def missing(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row is None]

    def merged(self, computed: Completed | None) -> Completed:
        """The request's rows in order: the cached ones and `computed` (the missing ones')."""
        if computed is None:  # everything was cached: no queue, no compute
            return Completed(np.stack([row for row in self.rows if row is not None]), 0.0, 0.0)
        rows = iter(computed.embeddings)
        stacked = np.stack([next(rows) if row is None else row for row in self.rows])
        return Completed(stacked, computed.queue_s, computed.compute_s)

    def located(self, error: ClipserveError) -> ClipserveError:
        """`error` naming its item's place in the request: the tower saw only the missing."""
        match = _ITEM.match(error.message)
        if match is None and len(self.missing) == 1 < len(self.rows):
            # One item went to the tower, which names none: it is that item.
            return with_item_index(error, self.missing[0])
        if match is None or int(match[1]) >= len(self.missing):
            return error
        stripped = copy.copy(error)
        stripped.message = error.message[match.end() :]
        return with_item_index(stripped, self.missing[int(match[1])])
