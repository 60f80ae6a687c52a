"""What the dedupe tests share: small photos written here, and the real local client with a
recorder around it that counts what it is sent and can fail one call (an interrupted run).

The tiny model's weights are random: these pictures score 0.95-0.996 to each other and a
re-encode >= 0.9999 to its original, so the tests group at THRESHOLD."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from PIL import Image

from clipserve.client import Client, Embedded, ServerGone

THRESHOLD = 0.999
T = TypeVar("T")


def picture(seed: int, size: tuple[int, int] = (96, 64)) -> Image.Image:
    """A smooth random picture: 8 x 8 noise upscaled, so re-encodes stay close to it and
    different seeds are far apart."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    return small.resize(size, Image.Resampling.BICUBIC)


def write_photo(path: Path, seed: int, quality: int = 90) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = picture(seed)
    if path.suffix.lower() in (".jpg", ".jpeg"):
        img.save(path, "JPEG", quality=quality)
    else:
        img.save(path)
    return path


def returns_within(call: Callable[[], T], fifos: Sequence[Path], timeout: float = 60) -> T:
    """call()'s answer, run in a thread: one still blocked after `timeout` (a regression that
    opens a FIFO for reading and waits for a writer) fails the test instead of hanging the
    suite, after the FIFOs are given a writer so that the thread ends too."""
    answer: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            answer.append(call())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        deadline = time.monotonic() + 10
        while thread.is_alive() and time.monotonic() < deadline:
            for fifo in fifos:
                # ENXIO unless a reader waits; opening and closing lets it read EOF.
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(0.1)
        pytest.fail(f"still blocked after {timeout:g} s: a FIFO was opened for reading")
    if error:
        raise error[0]
    return answer[0]


@dataclass
class Recorder:
    """The embedder `clipserve dedupe` is given: the real client, counted."""

    client: Client
    sent: int = 0
    calls: int = 0
    fail_on_call: int | None = None  # this call (1-based) raises as if the server had gone

    def info(self) -> Mapping[str, object]:
        return self.client.info()

    def embed_images_checked(self, images: Sequence[str | bytes]) -> Embedded:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise ServerGone("the server went away")
        self.sent += len(images)
        return self.client.embed_images_checked(images)
