"""multipart/form-data bodies (what `curl -F` and browsers send) → the files in them, in order."""

from __future__ import annotations

from python_multipart.multipart import MultipartParser, parse_options_header

from clipserve.errors import InvalidBody, TooManyItems


def boundary_of(content_type: str) -> bytes:
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidBody("multipart/form-data without a boundary parameter")
    return boundary


def parse_files(content_type: str, body: bytes, max_items: int) -> list[bytes]:
    """Every part is one image; parts must be files (have a filename)."""
    files: list[bytes] = []
    parts: list[list[bytes]] = []
    headers: list[dict[bytes, bytes]] = []
    field: list[bytes] = []

    def on_part_begin() -> None:
        if len(parts) >= max_items:
            raise TooManyItems(f"more than {max_items} files in one request "
                               "(--max-items-per-request)")  # fmt: skip
        parts.append([])
        headers.append({})

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1].append(data[start:end])

    def on_header_field(data: bytes, start: int, end: int) -> None:
        field.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        headers[-1][b"".join(field).lower()] = data[start:end]
        field.clear()

    parser = MultipartParser(boundary_of(content_type), {
        "on_part_begin": on_part_begin, "on_part_data": on_part_data,
        "on_header_field": on_header_field, "on_header_value": on_header_value,
    })  # fmt: skip
    try:
        parser.write(body)
        parser.finalize()
    except (TooManyItems, InvalidBody):
        raise
    except Exception as e:  # python-multipart raises its own parse errors
        raise InvalidBody(f"malformed multipart body ({e})") from None
    for index, (chunks, part_headers) in enumerate(zip(parts, headers, strict=True)):
        _, options = parse_options_header(part_headers.get(b"content-disposition", b""))
        if b"filename" not in options:
            name = options.get(b"name", b"?").decode("latin-1")
            raise InvalidBody(
                f"part {index} ({name!r}) is not a file; send images with -F name=@file"
            )
        files.append(b"".join(chunks))
    if not files:
        raise InvalidBody("multipart body holds no files")
    return files
