"""The real local client on the tiny model, shared by the dedupe tests of a module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clipserve.client import Client
from tests.dedupe.library import Recorder


@pytest.fixture(scope="module")
def local_client(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[Client]:
    with Client(
        None,
        mode="local",
        model=str(tiny_config),
        checkpoint=str(tiny_checkpoint),
        pretrained="none",
    ) as client:
        yield client


@pytest.fixture
def recorder(local_client: Client) -> Callable[..., Recorder]:
    """A fresh count around the shared client: recorder(fail_on_call=2)."""
    return lambda **kw: Recorder(local_client, **kw)
