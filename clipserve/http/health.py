"""Liveness and readiness, decided once for every front door's probes (/healthz and /readyz,
KServe's /v2/health/* and model readiness)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clipserve.batching.tower import TOWER_KINDS, TowerKind, TowerState
from clipserve.inference.self_check import blocks_readiness


@dataclass(frozen=True)
class Liveness:
    """False once a tower has no live worker, so the orchestrator restarts the process (a lost
    device does not come back by itself)."""

    dead: tuple[TowerKind, ...]

    @property
    def ok(self) -> bool:
        return not self.dead

    @property
    def reason(self) -> str:
        return "; ".join(f"{kind} tower: no live worker" for kind in self.dead)


@dataclass(frozen=True)
class Readiness:
    """True while every worker of every tower is alive and the server is not stopping; each
    worker's state by name."""

    workers: dict[str, str]  # "cpu" / "text:cpu" -> "ok" or "dead: <error>"
    ok: bool
    stopping: bool = False  # SIGTERM's --shutdown-delay-s: still serving, no longer ready


def liveness(towers: Mapping[TowerKind, TowerState]) -> Liveness:
    return Liveness(tuple(kind for kind in TOWER_KINDS if not towers[kind].alive))


def readiness(
    towers: Mapping[TowerKind, TowerState],
    self_check: Mapping[str, Any] | None = None,
    stopping: bool = False,
) -> Readiness:
    """Every worker alive, the startup self-check not failed under --self-check strict, and
    no SIGTERM taken."""
    workers = [w for kind in TOWER_KINDS for w in towers[kind].workers]
    states = {
        (w.device if w.kind == "image" else f"{w.kind}:{w.device}"): (
            "ok" if w.alive else f"dead: {w.error}"
        )
        for w in workers
    }
    alive = all(w.alive for w in workers) and not blocks_readiness(self_check)
    return Readiness(states, alive and not stopping, stopping)


def tower_ready(tower: TowerState) -> bool:
    return all(w.alive for w in tower.workers)
