"""Request bodies → the items to embed. Pure: bytes and media types in, no Starlette."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from clipserve.errors import UnsupportedMediaType

IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp")


@dataclass
class Payload:
    """Encoded images to decode, or one already-preprocessed tensor batch."""

    protocol: str  # metrics label: jpeg, png, webp, ...
    images: list[bytes] = field(default_factory=list)
    tensor: np.ndarray | None = None
    single: bool = False  # answer {"embedding": ...} rather than {"embeddings": [...]}

    def __len__(self) -> int:
        return len(self.images) if self.tensor is None else int(self.tensor.shape[0])


def protocol_label(media: str) -> str:
    return {"image/jpeg": "jpeg", "image/png": "png", "image/webp": "webp"}.get(media, "other")


def check_media_type(media: str) -> None:
    """Refuse an unsupported Content-Type before reading the body."""
    if media not in IMAGE_TYPES:
        shown = media or "(none)"
        raise UnsupportedMediaType(
            f"Content-Type {shown} is not supported; send one of {', '.join(IMAGE_TYPES)}"
        )


def parse_body(media: str, body: bytes) -> Payload:
    check_media_type(media)
    return Payload(protocol_label(media), images=[body], single=True)
