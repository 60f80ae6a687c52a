"""Image URLs, recognised on every door: this server does not fetch them, and a URL must never
come back as the embedding of something else (its text, or a decode error that hides why).

A URL is one `http://` or `https://` token without whitespace; "https://x.org is down" is a
caption.
"""

from __future__ import annotations

from clipserve.errors import ImageUrlRefused

SCHEMES = ("http://", "https://")
MAX_URL = 8192  # longer is not a URL anyone fetches: read as whatever else it is


def is_url(item: str | bytes) -> bool:
    head = item[:8].lower()
    if isinstance(head, bytes):
        head = head.decode("latin-1")
    return head.startswith(SCHEMES) and len(item) <= MAX_URL and len(item.split()) == 1


def url_refused() -> ImageUrlRefused:
    return ImageUrlRefused(
        "image URLs are not fetched by this server (--allow-url-fetch is off); send the image "
        "itself (a data:image/...;base64, URI or base64 of the file)"
    )
