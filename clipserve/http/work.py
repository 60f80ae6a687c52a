"""What a front door hands the pipeline and gets back: the parsed work, its embeddings, the answer.

A `Call` is one inference request as its front door reads it. The door makes it from the
request's path and headers before the body is read (so a bad media type, model or parameter is
refused without reading it); the pipeline then runs every call the same way (`Pipeline.serve`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

from clipserve.batching.tower import Completed, TowerKind

Parsed = TypeVar("Parsed")


@dataclass
class ImageWork:
    """A request's images: encoded (decoded in the pool) or an already validated tensor."""

    protocol: str  # the metrics label: jpeg, multipart, raw-tensor, openai-image, ...
    images: Sequence[bytes] = ()
    tensor: np.ndarray | None = None
    single: bool = False  # one image in, one embedding out (not a list)
    positions: Sequence[int] = ()  # each image's index in a request that mixes in texts (errors)
    # --allow-url-fetch: images[i] is fetched from urls[i] before decoding (b"" until then)
    urls: Mapping[int, str] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.tensor) if self.tensor is not None else len(self.images)


@dataclass
class TextWork:
    protocol: str
    texts: list[str]
    tokens: np.ndarray | None = None  # already tokenised (e.g. to count usage): not done twice


@dataclass
class Work(Generic[Parsed]):
    """A parsed request: what it asks of each tower, and the door's own reading of the body
    (`parsed`), which only the door's `encode` looks at."""

    protocol: str  # the metrics label of the request as a whole
    parsed: Parsed
    images: ImageWork | None = None
    texts: TextWork | None = None
    normalize: bool = True
    fresh: bool = False  # Cache-Control: no-cache: nothing read from the embedding cache
    # Bytes the parse brought into memory besides the body (read from shared memory): held
    # against --max-body-bytes-in-flight, like the body's, until the request ends.
    held_bytes: int = 0

    def count(self, tower: TowerKind) -> int:
        if tower == "image":
            return 0 if self.images is None else self.images.count
        return 0 if self.texts is None else len(self.texts.texts)


@dataclass
class Embedded:
    """Each tower's embeddings of one request, in the order of its items."""

    images: Completed | None = None
    texts: Completed | None = None


@dataclass
class Encoded:
    """A 200 answer's body, media type and extra headers."""

    content: bytes
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)


class Call(Protocol[Parsed]):
    """One inference request as its front door parses and answers it."""

    @property
    def tower(self) -> TowerKind:
        """Where the one place admitted before parsing is held (grown or given back once the
        body is parsed)."""
        ...

    @property
    def inline(self) -> bool:
        """Parse on the event loop: only for bodies whose parsing is a few checks and a view
        (a raw tensor), where a hop to the pool would cost more than the work."""
        ...

    def parse(self, body: bytes) -> Work[Parsed]:
        """Bytes to work; runs in the decode pool unless `inline`. Raises domain errors."""
        ...

    def encode(self, work: Work[Parsed], done: Embedded) -> Encoded: ...
