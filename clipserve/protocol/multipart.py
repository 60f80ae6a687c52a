"""multipart/form-data bodies (what `curl -F` and browsers send) → the files in them, in order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from clipserve.errors import InvalidBody, TooManyItems

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

MAX_BOUNDARY = 70  # RFC 2046 §5.1.1; python-multipart raises (outside any handler) past 256
# A part needs Content-Disposition and perhaps Content-Type; browsers send two headers.
MAX_PART_HEADERS = 16
MAX_PART_HEADER_BYTES = 8192
# python-multipart parses parameters in Python, ~2.5 µs a character; real ones are < 200.
MAX_CONTENT_TYPE = 1024
# python-multipart walks each partial match of a delimiter byte by byte in Python: a 30 MiB
# body of them held the decode thread ~4 s (20 times a plain body's time). A body has one
# delimiter a part; random image bytes hold its first 5 bytes about once a terabyte.
SPARE_DELIMITERS = 64


def boundary_of(content_type: str) -> bytes:
    if len(content_type) > MAX_CONTENT_TYPE:
        raise InvalidBody(
            f"Content-Type of {len(content_type)} characters; at most {MAX_CONTENT_TYPE} are read"
        )
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidBody("multipart/form-data without a boundary parameter")
    if len(boundary) > MAX_BOUNDARY:
        raise InvalidBody(
            f"multipart boundary of {len(boundary)} characters; "
            f"RFC 2046 allows at most {MAX_BOUNDARY}"
        )
    return boundary


def parse_files(content_type: str, body: bytes, max_items: int) -> list[bytes]:
    """Every part is one image; parts must be files (have a filename)."""
    files: list[bytes] = []
    parts: list[list[bytes]] = []
    dispositions: list[bytes] = []  # the only header read; others are skipped, not kept
    field: list[bytes] = []

    def on_part_begin() -> None:
        if len(parts) >= max_items:
            raise TooManyItems(
                f"more than {max_items} files in one request (--max-items-per-request)"
            )
        parts.append([])
        dispositions.append(b"")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1].append(data[start:end])

    def on_header_field(data: bytes, start: int, end: int) -> None:
        field.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        if b"".join(field).lower() == b"content-disposition":
            dispositions[-1] = data[start:end]
        field.clear()

    callbacks: MultipartCallbacks = {
        "on_part_begin": on_part_begin,
        "on_part_data": on_part_data,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
    }
    boundary = boundary_of(content_type)
    if body.count(b"\r\n--" + boundary[:1]) > max_items + SPARE_DELIMITERS:
        raise InvalidBody("multipart body holds more delimiter-like lines than it may hold parts")
    try:
        parser = MultipartParser(
            boundary,
            callbacks,
            max_header_count=MAX_PART_HEADERS,
            max_header_size=MAX_PART_HEADER_BYTES,
        )
        parser.write(body)
        parser.finalize()  # checks nothing (python-multipart 0.0.34): the state says
        if parser.state != MultipartState.END:
            raise InvalidBody(
                "multipart body ends before its closing boundary ('--' boundary '--')"
            )
    except (TooManyItems, InvalidBody):
        raise
    except Exception as e:  # python-multipart raises its own parse errors
        raise InvalidBody(f"malformed multipart body ({e})") from None
    for index, (chunks, disposition) in enumerate(zip(parts, dispositions, strict=True)):
        _, options = parse_options_header(disposition)
        if b"filename" not in options:
            name = options.get(b"name", b"?").decode("latin-1")[:100]
            raise InvalidBody(
                f"part {index} ({name!r}) is not a file; send images with -F name=@file"
            )
        files.append(b"".join(chunks))
    if not files:
        raise InvalidBody("multipart body holds no files")
    return files
