"""The servers bench/jpeg_decoders.py's `served` section compares, round by round: each variant a
clipserve of this tree whose decoding a PYTHONPATH shim changes (simplejpeg hidden, the draft
margin, the fast path's settings) or a server flag chooses."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.frontend.servers import Server, clipserve, fake_flags

BASELINE = "pillow draft margin 1 (today's decode)"
# inference/jpeg.py's decode settings as round 2 had them (fancy upsampling, RGB out).
ROUND_2 = {"FAST_UPSAMPLE_SHRINK": None}


def shim(
    tmp: Path,
    name: str,
    hide_simplejpeg: bool,
    margin: int | None,
    settings: dict[str, Any] | None = None,
) -> str:
    """A PYTHONPATH folder that hides simplejpeg (the Pillow fallback) and/or sets DRAFT_MARGIN
    and the fast path's decode settings in the server process (a sitecustomize, run before the
    server builds its decoder)."""
    folder = tmp / name
    folder.mkdir()
    if hide_simplejpeg:
        (folder / "simplejpeg.py").write_text("raise ImportError('hidden: the Pillow path')\n")
    lines = []
    if margin is not None:
        lines += ["import clipserve.inference.preprocess as p", f"p.DRAFT_MARGIN = {margin}"]
    if settings:
        lines.append("import clipserve.inference.jpeg as j")
        lines += [f"j.{k} = {v!r}" for k, v in settings.items()]
    if lines:
        (folder / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    return f"{folder}:{REPO}"


Variant = tuple[str, bool, int | None, dict[str, Any] | None]
ROUND_2_VARIANTS: list[Variant] = [
    (BASELINE, True, 1, None),
    ("pillow draft margin 2 (the fallback now)", True, None, None),
    ("fast path (margin 2, the default)", False, None, None),
    ("fast path at margin 1 (round 1's parity)", False, 1, None),
]
ROUND_3_VARIANTS: list[Variant] = [
    (BASELINE, True, 1, None),
    ("fast path, round 2 (fancy upsampling)", False, None, ROUND_2),
    ("fast path, round 3 default (plain upsampling at >= 2x shrink)", False, None, None),
]
ROUND_4_VARIANTS: list[Variant] = [
    (BASELINE, True, 1, None),
    ("fast path (the default)", False, None, None),
]
FAST_SCALING = "fast path, --jpeg-scaling fast (Pillow draft's margin)"
ROUND_6_VARIANTS: list[Variant] = [*ROUND_4_VARIANTS, (FAST_SCALING, False, None, None)]
ROUNDS = {
    "round_3": ROUND_3_VARIANTS,
    "round_4": ROUND_4_VARIANTS,
    "round_5": ROUND_4_VARIANTS,
    "round_6": ROUND_6_VARIANTS,
}
# Variants that are a server flag rather than a shim.
VARIANT_FLAGS = {FAST_SCALING: ["--jpeg-scaling", "fast"]}


def served_variants(
    tmp: Path,
    model: Path,
    head: bool,
    variants: list[Variant] = ROUND_2_VARIANTS,
    before: Path | None = None,
) -> list[Server]:
    flags = fake_flags(model)
    out: list[Server] = []
    for name, hide, margin, settings in variants:
        server = clipserve(name, [*flags, *VARIANT_FLAGS.get(name, [])])
        env_path = shim(tmp, f"shim{len(out)}", hide, margin, settings)
        server.env = {**os.environ, "PYTHONPATH": env_path}
        out.append(server)
    if head:
        tree = tmp / "head"
        tree.mkdir()
        archive = subprocess.run(
            ["git", "archive", "HEAD"], cwd=REPO, check=True, capture_output=True
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        out.append(clipserve("HEAD tree (committed)", flags, tree))
    if before is not None:  # its defaults: the fast path as that tree has it
        out.append(clipserve(f"before tree ({before.name})", flags, before))
    return out
