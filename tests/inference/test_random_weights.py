"""--pretrained none builds its random weights from one seed: every load, in any process, is
the same model, so a client's local mode, the engine and an export agree (and an ONNX export of
random weights is reused rather than written again per start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipserve.config import ModelConfig
from clipserve.inference.model import load_model


def _digest_script(config: Path) -> str:
    return (
        "from clipserve.config import ModelConfig\n"
        "from clipserve.inference.model import load_model\n"
        f"m = load_model(ModelConfig(model={str(config)!r}, pretrained='none'))\n"
        "print(m.visual_digest)\n"
    )


def test_random_weights_are_one_model_in_every_load(tiny_config: Path) -> None:
    config = ModelConfig(model=str(tiny_config), pretrained="none")
    first = load_model(config)
    torch.rand(1000)  # the global generator moves on between the loads
    again = load_model(config)
    mine, theirs = first.module.state_dict(), again.module.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow  # a process of its own (~6 s of imports); CI runs it (make test-slow)
def test_random_weights_are_one_model_in_another_process(tiny_config: Path) -> None:
    first = load_model(ModelConfig(model=str(tiny_config), pretrained="none"))
    out = subprocess.run(
        [sys.executable, "-c", _digest_script(tiny_config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split()[-1] == first.visual_digest


def test_loading_random_weights_leaves_the_callers_generator_alone(tiny_config: Path) -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    load_model(ModelConfig(model=str(tiny_config), pretrained="none"))
    assert torch.equal(torch.rand(3), expected)
