"""The request pipeline driven directly: no uvicorn, no HTTP, the real batcher and fake executor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clipserve.errors import InvalidImage, Overloaded
from clipserve.http.pipeline import ImageWork, Pipeline, RequestContext, TextWork
from clipserve.http.timing import StageTimer
from clipserve.inference.runtime import build_runtime
from clipserve.inference.towers import Towers
from clipserve.metrics import Metrics
from tests.helpers import make_config, png_bytes, random_pixels


async def _never_disconnects() -> None:
    await asyncio.Event().wait()


def _context() -> RequestContext:
    return RequestContext("r", StageTimer(), time.perf_counter() + 30, _never_disconnects)


def drive(
    tiny_config: Path,
    tiny_checkpoint: Path,
    test: Callable[[Pipeline], Awaitable[None]],
    **flags: Any,
) -> None:
    runtime = build_runtime(make_config(tiny_config, tiny_checkpoint, backend="fake", **flags))

    async def main() -> None:
        towers = Towers.build(runtime, Metrics())
        towers.start()
        pool = ThreadPoolExecutor(1)
        try:
            await test(
                Pipeline(runtime.config, runtime, towers.image, towers.text, Metrics(), pool)
            )
        finally:
            await towers.stop()
            pool.shutdown()

    try:
        asyncio.run(main())
    finally:
        runtime.close()


def test_images_and_texts_walk_the_pipeline_and_give_back_their_places(
    tiny_config: Path, tiny_checkpoint: Path
) -> None:
    async def test(p: Pipeline) -> None:
        pixels = random_pixels(3)
        ctx = _context()
        async with p.admitted(p.towers["image"], ctx) as admitted:  # one place, before parsing
            work = ImageWork("png", images=[png_bytes(pixels)] * 3)  # parsed: three images
            done = await p.embed_images(work, ctx, admitted=admitted)
            assert admitted.n == 3  # grown to the parsed size
        fake = p.runtime.executors[0]  # type: ignore[attr-defined]
        want = fake.features(pixels[None]) @ fake._proj
        np.testing.assert_allclose(done.embeddings[0], want[0] / np.linalg.norm(want), rtol=1e-5)
        assert {"decode", "queue", "compute"} <= ctx.timer.stages.keys()
        texts = await p.embed_texts(TextWork("text-json", ["a cat", "a dog"]), _context())
        assert texts.embeddings.shape == (2, p.runtime.model.embed_dim)
        assert p.towers["image"].admission.used == p.towers["text"].admission.used == 0  # type: ignore[attr-defined]

    drive(tiny_config, tiny_checkpoint, test)


def test_a_bad_image_or_a_full_queue_releases_what_was_admitted(
    tiny_config: Path, tiny_checkpoint: Path
) -> None:
    async def test(p: Pipeline) -> None:
        with pytest.raises(InvalidImage, match="item 1"):
            good = png_bytes(random_pixels(1))
            await p.embed_images(ImageWork("png", images=[good, b"not an image"]), _context())
        ctx = _context()
        with pytest.raises(Overloaded):
            async with p.admitted(p.towers["image"], ctx) as admitted:
                await p.embed_images(ImageWork("png", images=[good] * 9), ctx, admitted=admitted)
        assert p.towers["image"].admission.used == 0  # type: ignore[attr-defined]

    drive(
        tiny_config,
        tiny_checkpoint,
        test,
        max_queue_size=8,
        max_batch_size=8,
        max_items_per_request=8,
    )
