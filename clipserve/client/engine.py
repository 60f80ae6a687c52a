"""What the client asks of a way to embed (the service, or the model in-process): the `Engine`
protocol, and `Embedded`, the vectors of a batch with the items that failed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from clipserve.client.inputs import Payload

Mode = Literal["remote", "local"]


@dataclass
class Embedded:
    """Embeddings of a sequence of images, in its order. `vectors` is float32 (N, D), L2-
    normalised, with NaN rows for the items that failed; `errors` maps each failed item's index
    to why (unreadable file, undecodable image, ...)."""

    vectors: np.ndarray
    errors: dict[int, str] = field(default_factory=dict)


class Engine(Protocol):
    """Embeds batches of at most `max_items`. Image failures come back in `Embedded.errors`
    (keyed by position in the batch, the reason only); a text that cannot be embedded raises
    `Unusable` with its position. Anything else raises a `ClientError`."""

    @property
    def mode(self) -> Mode: ...

    @property
    def dim(self) -> int: ...

    @property
    def max_items(self) -> int: ...

    async def start(self) -> None: ...

    async def embed_images(self, payloads: Sequence[Payload]) -> Embedded: ...

    async def embed_texts(self, texts: Sequence[str]) -> np.ndarray: ...

    async def info(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


def empty(n: int, dim: int) -> np.ndarray:
    """n rows of NaN: the vectors of items not (yet) embedded."""
    return np.full((n, dim), np.nan, dtype=np.float32)
