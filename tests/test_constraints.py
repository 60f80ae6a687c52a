"""constraints.txt, the versions make's installs and CI hold to: every dependency pyproject.toml
names for this platform (the dev extra's too) is pinned there, to a version its specifier takes,
so a new or raised dependency cannot be installed unpinned or fail to resolve."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    wanted = [Requirement(r) for r in named]
    return [r for r in wanted if r.marker is None or r.marker.evaluate()]


def test_every_dependency_is_pinned_to_a_version_it_allows() -> None:
    pins = _pins()
    requirements = _requirements()
    assert len(requirements) > 30
    missing = [str(r) for r in requirements if canonicalize_name(r.name) not in pins]
    assert not missing, f"not in constraints.txt (make constraints): {missing}"
    refused = [
        f"{r} but {pins[canonicalize_name(r.name)]}"
        for r in requirements
        if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not refused, refused


def test_make_installs_with_the_constraints() -> None:
    # What make would run were pyproject.toml newer than the installed stamp (nothing runs).
    dry = subprocess.run(
        ["make", "-n", "-W", "pyproject.toml", ".venv/.installed"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [line for line in dry.splitlines() if "pip install" in line and "-e" in line]
    assert installs and all(line.endswith("-c constraints.txt") for line in installs), dry
