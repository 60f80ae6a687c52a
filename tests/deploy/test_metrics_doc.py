"""docs/operations.md's metrics table against what a running server exports: every metric has a
row, and the `stage` values of clipserve_stage_duration_seconds are the ones the server times
(also listed in clipserve.metrics.STAGES and docs/load-generator.md)."""

from __future__ import annotations

import re
from pathlib import Path

from clipserve.metrics import STAGES
from tests.deploy.exported import exported_metrics

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
LOADGEN = ROOT / "docs" / "load-generator.md"
_HISTOGRAM_SAMPLE = re.compile(r"_(bucket|sum|count)$")


def _metrics_table() -> str:
    text = OPERATIONS.read_text()
    section = text[text.index("\n## Metrics\n") :]
    section = section[: section.index("\n## ", 1)]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `clipserve_"))


def _timed_stages() -> set[str]:
    """Every stage the request timer is given (`measure("x")`, `add("x", ...)`)."""
    source = " ".join(p.read_text() for p in (ROOT / "clipserve" / "http").glob("*.py"))
    return set(re.findall(r"timer\.(?:measure|add)\(\"(\w+)\"", source))


def test_every_exported_metric_has_a_row(tiny_config: Path, tiny_checkpoint: Path) -> None:
    documented = set(re.findall(r"`(clipserve_\w+)`", _metrics_table()))
    exported = exported_metrics(tiny_config, tiny_checkpoint).labels
    missing = {
        name
        for name in exported
        if not name.endswith("_created")
        and name not in documented
        and _HISTOGRAM_SAMPLE.sub("", name) not in documented
    }
    assert not missing, sorted(missing)


def test_every_timed_stage_is_documented() -> None:
    stages = _timed_stages()
    assert {"receive", "decode", "cache", "queue", "compute", "encode"} <= stages
    assert set(STAGES) == stages
    [row] = [r for r in _metrics_table().splitlines() if "`clipserve_stage_duration_seconds`" in r]
    listed = re.search(r"`stage` \(([^)]*)\)", row)
    assert listed is not None
    assert {part.split(":")[0].strip() for part in listed[1].split(",")} == stages
    assert f"({', '.join(STAGES)})" in " ".join(LOADGEN.read_text().split())
