"""The run's answer in `--out DIR`: groups.json (everything), groups.csv (one row per file in
a group) and report.html (thumbnails side by side, one self-contained file).

Paths are untrusted text (anyone can name a file `<script>…`): the HTML escapes every one, and
its Content-Security-Policy allows no script and no image but its own data: URIs anyway.
CSV cells are written as they are (a spreadsheet may read a path starting with `=` as a
formula: open the CSV as text, or read groups.json). A symlink is labelled as one (`symlink` in
the JSON and CSV, "(symlink)" in the HTML): deleting the file it points to loses the photo.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import orjson
from PIL import Image, ImageOps

from clipserve.config.schema import LimitsConfig
from clipserve.dedupe.group import Group
from clipserve.dedupe.scan import NotRead, Skipped, open_photo

log = logging.getLogger(__name__)

VERSION = 1
THUMBNAIL_PX = 160
THUMBNAIL_QUALITY = 70
THUMBNAIL_WORKERS = 4
# The most pixels one thumbnail decodes (after a JPEG's reduced-size draft), the server's
# --max-image-pixels default: Pillow's own limit lets each of the workers take ~0.5 GB.
THUMBNAIL_MAX_PIXELS = LimitsConfig().max_image_pixels
# Thumbnails cost ~5 KB each: past this many groups the HTML lists the rest by name only.
MAX_HTML_GROUPS = 1000
SIMILARITY_NOTE = (
    "group similarity: the minimum cosine over all pairs of its files (1.0 for exact "
    "copies); file similarity: cosine to the group's first file, the suggested one to keep "
    "(most pixels, then most bytes)"
)
CSV_COLUMNS = (
    "group",
    "kind",
    "group_similarity",
    "path",
    "similarity",
    "size",
    "width",
    "height",
    "sha256",
    "symlink",
    "copy_of",
)


@dataclass(frozen=True)
class Outcome:
    """What a run found: what the report files are written from."""

    model: str
    threshold: float
    photos: int  # readable photos found
    unique: int  # distinct content hashes among them
    embedded: int  # images sent to the embedder this run (the rest came from the cache)
    groups: list[Group]
    skipped: list[Skipped]


def write_reports(outcome: Outcome, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "groups.json", out / "groups.csv", out / "report.html"]
    paths[0].write_bytes(orjson.dumps(as_json(outcome), option=orjson.OPT_INDENT_2))
    paths[1].write_text(as_csv(outcome), encoding="utf-8", newline="")
    paths[2].write_text(as_html(outcome), encoding="utf-8")
    return paths


def counts(outcome: Outcome) -> dict[str, int]:
    groups = outcome.groups
    exact = sum(g.exact_copies for g in groups)
    return {
        "photos": outcome.photos,
        "unique": outcome.unique,
        "embedded": outcome.embedded,
        "groups": len(groups),
        "exact_groups": sum(g.kind == "exact" for g in groups),
        "near_groups": sum(g.kind == "near" for g in groups),
        "duplicates": sum(len(g.members) - 1 for g in groups),  # files beyond one per group
        # Of those, the byte-identical copies (in near groups too) and the rest.
        "exact_copies": exact,
        "near_copies": sum(len(g.members) - 1 for g in groups) - exact,
        "skipped": len(outcome.skipped),
    }


def as_json(outcome: Outcome) -> dict[str, object]:
    return {
        "version": VERSION,
        "model": outcome.model,
        "threshold": outcome.threshold,
        "similarity": SIMILARITY_NOTE,
        "counts": counts(outcome),
        "groups": [
            {
                "kind": g.kind,
                "similarity": g.similarity,
                "files": [m.photo.path for m in g.members],
                "members": [
                    {
                        "path": m.photo.path,
                        "similarity": m.similarity,
                        "size": m.photo.size,
                        "width": m.photo.width,
                        "height": m.photo.height,
                        "sha256": m.photo.sha256,
                        "symlink": m.photo.link,
                        "copy_of": copy_of,
                    }
                    for m, copy_of in zip(g.members, g.copy_of(), strict=True)
                ],
            }
            for g in outcome.groups
        ],
        "skipped": [{"path": s.path, "reason": s.reason} for s in outcome.skipped],
    }


def as_csv(outcome: Outcome) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for number, g in enumerate(outcome.groups, 1):
        for m, copy_of in zip(g.members, g.copy_of(), strict=True):
            p = m.photo
            row = (number, g.kind, g.similarity, p.path, m.similarity, p.size)
            writer.writerow((*row, p.width, p.height, p.sha256, p.link, copy_of or ""))
    return out.getvalue()


def thumbnail(path: str, max_pixels: int | None = None) -> str | None:
    """A small upright JPEG of the photo as a data: URI, or None if it cannot be read or would
    decode more than `max_pixels` (THUMBNAIL_MAX_PIXELS); the header says before any decode."""
    max_pixels = THUMBNAIL_MAX_PIXELS if max_pixels is None else max_pixels
    try:
        with open_photo(path) as f, Image.open(f) as img:
            img.draft("RGB", (THUMBNAIL_PX, THUMBNAIL_PX))  # a JPEG decodes at up to 1/8 size
            width, height = img.size
            if width * height > max_pixels:
                raise ValueError(
                    f"{width}x{height} image has {width * height} pixels to decode; "
                    f"the limit is {max_pixels} (the server's --max-image-pixels default)"
                )
            small = ImageOps.exif_transpose(img).convert("RGB")
        small.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
        out = io.BytesIO()
        small.save(out, "JPEG", quality=THUMBNAIL_QUALITY)
    except (
        OSError,
        ValueError,
        SyntaxError,
        EOFError,
        MemoryError,
        NotRead,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,  # raised where warnings are errors (the tests)
    ) as e:
        log.warning("no thumbnail for %s: %s", path, e)
        return None
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def as_html(outcome: Outcome) -> str:
    shown = outcome.groups[:MAX_HTML_GROUPS]
    paths = [m.photo.path for g in shown for m in g.members]
    with ThreadPoolExecutor(THUMBNAIL_WORKERS) as pool:
        thumbs = dict(zip(paths, pool.map(thumbnail, paths), strict=True))
    c = counts(outcome)
    parts = [
        _HEAD,
        f"<h1>Duplicate photos: {c['groups']} groups, {c['duplicates']} extra copies "
        f"({c['exact_copies']} byte-identical)</h1>",
        f"<p class=meta>{c['photos']} photos ({c['unique']} distinct files), model "
        f"{_e(outcome.model)}, threshold {outcome.threshold:g}, {c['skipped']} skipped. "
        f"{_e(SIMILARITY_NOTE)}.</p>",
    ]
    for number, g in enumerate(shown, 1):
        parts.append(
            f"<section><h2>Group {number}: {g.kind}, {len(g.members)} files, "
            f"similarity {g.similarity:.4f}</h2><div class=row>"
        )
        first_with: dict[str, int] = {}  # content hash → its first card's number in the group
        for i, m in enumerate(g.members):
            p, uri = m.photo, thumbs[m.photo.path]
            img = f'<img src="{uri}" alt="">' if uri else "<div class=none>no preview</div>"
            keep = " keep" if i == 0 else ""
            same = first_with.setdefault(p.sha256, i + 1)
            note = " (suggested keep)" if i == 0 else ""
            note += f" (same bytes as file {same})" if same != i + 1 else ""
            note += " (symlink)" if p.link else ""
            parts.append(
                f'<figure class="card{keep}">{img}<figcaption>'
                f'<a href="{_e(_href(p.path))}">{_e(p.path)}</a><br>'
                f"{_size(p.size)}, {p.width}&times;{p.height}, similarity {m.similarity:.4f}"
                f"{note}</figcaption></figure>"
            )
        parts.append("</div></section>")
    if len(outcome.groups) > len(shown):
        parts.append(
            f"<p>{len(outcome.groups) - len(shown)} more groups, without previews: "
            "see groups.json.</p>"
        )
    if outcome.skipped:
        parts.append(f"<details><summary>{len(outcome.skipped)} files skipped</summary><ul>")
        parts.extend(f"<li>{_e(s.path)}: {_e(s.reason)}</li>" for s in outcome.skipped)
        parts.append("</ul></details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _href(path: str) -> str:
    """A file: link (percent-encoded by pathlib) that opens the photo itself."""
    return Path(path).as_uri() if Path(path).is_absolute() else "#"


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<title>clipserve dedupe report</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
.meta { color: #555; max-width: 70em; }
section { border-top: 1px solid #ddd; padding: .5em 0; }
h2 { font-size: 15px; }
.row { display: flex; flex-wrap: wrap; gap: 12px; }
.card { margin: 0; width: 180px; padding: 6px; border: 1px solid #ddd; border-radius: 4px; }
.card.keep { border-color: #2a7; }
.card img { display: block; margin: 0 auto; max-width: 160px; max-height: 160px; }
.none { height: 120px; line-height: 120px; text-align: center; color: #999; }
figcaption { font-size: 12px; overflow-wrap: anywhere; margin-top: 4px; }
figcaption a { word-break: break-all; }
</style></head><body>"""
