"""Text requests: {"texts": [...]} in JSON or msgpack."""

from __future__ import annotations

from clipserve.errors import InvalidBody, InvalidText, TextTooLong, TooManyTexts
from clipserve.protocol.media import JSON, media_type
from clipserve.protocol.requests import MSGPACK_TYPES, check_media_type, loads_json, unpack_msgpack

TEXT_TYPES = (JSON, *MSGPACK_TYPES)


def text_protocol(content_type: str | None) -> str:
    """The request's metrics label, after refusing what is not a text body (before reading)."""
    media = media_type(content_type)
    check_media_type(media, TEXT_TYPES)
    return "text-json" if media == JSON else "text-msgpack"


def parse_texts(
    content_type: str, body: bytes, max_texts: int, max_chars: int, *, truncate: bool = False
) -> list[str]:
    return texts_from(text_protocol(content_type), body, max_texts, max_chars, truncate=truncate)


def texts_from(
    protocol: str, body: bytes, max_texts: int, max_chars: int, *, truncate: bool = False
) -> list[str]:
    """The texts of a body whose Content-Type `text_protocol` has checked already."""
    if protocol == "text-json":
        doc = loads_json(body, max_texts, TooManyTexts)
    else:
        doc = unpack_msgpack(body, max_texts, TooManyTexts)
    if not isinstance(doc, dict) or not isinstance(doc.get("texts"), list):
        raise InvalidBody('the body must be {"texts": ["...", ...]}')
    texts: list[str] = doc["texts"]
    if not texts:
        raise InvalidText('"texts" is empty')
    if len(texts) > max_texts:
        raise TooManyTexts(
            f"{len(texts)} texts in one request; the limit is {max_texts} (--max-items-per-request)"
        )
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidText(f"item {index}: expected a string, got {type(text).__name__}")
    return [check_length(text, index, max_chars, truncate) for index, text in enumerate(texts)]


def check_length(text: str, index: int, max_chars: int, truncate: bool = False) -> str:
    """The one --max-text-chars check, for every route that takes texts: the text, or with
    `truncate` its first `max_chars` characters (the tokenizer then cuts it to the context)."""
    if len(text) <= max_chars:
        return text
    if truncate:
        return text[:max_chars]
    raise TextTooLong(
        f"item {index}: {len(text)} characters; the limit is {max_chars} (--max-text-chars)"
    )
