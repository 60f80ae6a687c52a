"""What every section of the GPU check is given: the plan, and a way to save partial results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clipserve.backends.device import cuda_index, is_cpu, is_cuda

# Saves a section's partial result, in case it fails or runs out of time later.
Emit = Callable[[dict[str, Any]], None]


@dataclass
class Plan:
    """Everything a section needs, written to a file for the section's own process."""

    device: str  # "cuda:0" or "cpu"
    quick: bool
    model: str  # open_clip name or a JSON config path
    workers: int
    depths: list[int]
    out_dir: str
    sizes: list[int] = field(default_factory=list)
    reuse_port: bool = False  # with workers > 1: a listening socket per front end

    @property
    def gpus(self) -> str:
        return "cpu" if is_cpu(self.device) else str(cuda_index(self.device))

    @property
    def cuda(self) -> bool:
        return is_cuda(self.device)
