"""`AsyncClient`: embeddings of many images or texts, in input order, from the service, the model
in-process, or the service with the model as fallback. It cuts the input into batches and keeps
`concurrency` of them in flight; the engine (remote.py, local.py, auto.py) embeds each batch.

Files are read batch by batch, off the event loop, so a run over many photos holds only the
batches in flight. Batches are taken in input order; when a strict call meets a bad item it
takes no new batches, lets those in flight finish and raises for the lowest bad index, which
is then the first bad item of the whole input.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Literal

import httpx
import numpy as np

from clipserve.client.auto import AutoEngine
from clipserve.client.engine import Embedded, Engine, Mode, empty
from clipserve.client.errors import InvalidInput
from clipserve.client.inputs import ImageInput, Payload, Unusable, load_all, source_of
from clipserve.client.local import LocalEngine
from clipserve.client.progress import Progress
from clipserve.client.remote import ImageFormat, RemoteEngine

DEFAULT_URL = "http://127.0.0.1:8000"
ClientMode = Literal["remote", "local", "auto"]
# A batch's work: embed items [start, stop), record failures, and say whether to go on.
Work = Callable[[int, int], Awaitable[bool]]


class AsyncClient:
    """The async client; `async with` it, or call `aclose()` at the end."""

    def __init__(
        self,
        url: str | None = DEFAULT_URL,
        *,
        mode: ClientMode = "remote",
        model: str = "ViT-B-32",
        pretrained: str = "laion2b_s34b_b79k",
        checkpoint: str | None = None,
        api_key: str | None = None,
        batch_size: int = 32,
        concurrency: int = 4,
        timeout_s: float = 60.0,
        retries: int = 5,
        progress: bool | None = None,
        image_format: ImageFormat = "encoded",
        device: str = "cpu",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`url`: the service (remote and auto modes). `model`, `pretrained`, `checkpoint`:
        the model in local mode and auto's fallback, as the server's flags of those names
        take them; `device` is where it runs (`cpu`, `auto`, or GPU ids as in --gpus).
        `batch_size`: items per request (within the server's limits) or local batch;
        `concurrency`: requests in flight; `timeout_s`: each request's deadline, sent as
        X-Request-Timeout-Ms; `retries`: more attempts after a refused connection or a
        503/429. `image_format="tensor"` decodes and crops on this machine and sends uint8
        pixels (for a client with cores to spare). `progress`: a bar on stderr; None: only
        when stderr is a terminal. `transport`: httpx's, for proxies or custom TLS."""
        if mode not in ("remote", "local", "auto"):
            raise ValueError(f"mode must be remote, local or auto, got {mode!r}")
        if image_format not in ("encoded", "tensor"):
            raise ValueError(f"image_format must be encoded or tensor, got {image_format!r}")
        for name, value in (("batch_size", batch_size), ("concurrency", concurrency)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if timeout_s <= 0 or retries < 0:
            raise ValueError("timeout_s must be positive and retries at least 0")
        if mode != "local" and not url:
            raise ValueError(f"mode={mode} needs the service's url")

        def remote() -> RemoteEngine:
            assert url
            return RemoteEngine(
                url,
                api_key=api_key,
                batch_size=batch_size,
                concurrency=concurrency,
                timeout_s=timeout_s,
                retries=retries,
                image_format=image_format,
                transport=transport,
            )

        def local() -> LocalEngine:
            return LocalEngine(
                model=model,
                pretrained=pretrained,
                checkpoint=checkpoint,
                batch_size=batch_size,
                device=device,
            )

        self.mode = mode
        self._engine: Engine
        if mode == "remote":
            self._engine = remote()
        elif mode == "local":
            self._engine = local()
        else:
            self._engine = AutoEngine(remote(), local())
        self._concurrency = concurrency
        self._progress = progress
        self._started = False
        self._starting = asyncio.Lock()

    @property
    def mode_in_use(self) -> Mode:
        """Where embeddings come from now; in auto mode, decided by `start()`."""
        if self.mode == "auto" and not self._started:
            raise RuntimeError("auto mode decides on first use: await start() first")
        return self._engine.mode

    async def start(self) -> None:
        """Connect (GET /info) or load the model; every call does it on first use."""
        async with self._starting:
            if not self._started:
                await self._engine.start()
                self._started = True

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._engine.aclose()

    async def info(self) -> dict[str, Any]:
        """The server's GET /info; in local mode the same shape, built locally."""
        await self.start()
        return await self._engine.info()

    async def embed_images(self, images: Sequence[ImageInput]) -> np.ndarray:
        """float32 (N, D) L2-normalised embeddings in input order; InvalidInput for the first
        item that cannot be embedded."""
        vectors, errors = await self._embed_images(images, strict=True)
        if errors:
            first = min(errors)
            raise InvalidInput(first, source_of(images[first], first), errors[first])
        return vectors

    async def embed_images_checked(self, images: Sequence[ImageInput]) -> Embedded:
        """Every item that can be embedded is; the others are NaN rows, and in `errors` as
        "<source>: <why>"."""
        vectors, errors = await self._embed_images(images, strict=False)
        named = {i: f"{source_of(images[i], i)}: {why}" for i, why in sorted(errors.items())}
        return Embedded(vectors, named)

    async def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """float32 (N, D) L2-normalised text embeddings in input order."""
        if isinstance(texts, str):
            raise TypeError("embed_texts takes a sequence of texts, not one str")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidInput(i, f"<text #{i}>", f"expected a str, got {type(text).__name__}")
            try:  # a lone surrogate cannot go on the wire: refused in local mode too, alike
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidInput(
                    i, f"<text #{i}>", f"not valid Unicode text ({e.reason} at {e.start})"
                ) from None
        await self.start()
        out = empty(len(texts), self._engine.dim)
        errors: dict[int, str] = {}

        async def batch(start: int, stop: int) -> bool:
            try:
                out[start:stop] = await self._engine.embed_texts(list(texts[start:stop]))
            except Unusable as e:
                errors[start + e.position] = e.reason
                return False
            return True

        await self._batches(len(texts), batch, "embedding texts")
        if errors:
            first = min(errors)
            raise InvalidInput(first, f"<text #{first}>", errors[first])
        return out

    async def _embed_images(
        self, images: Sequence[ImageInput], strict: bool
    ) -> tuple[np.ndarray, dict[int, str]]:
        if isinstance(images, str | bytes | np.ndarray) and not (
            isinstance(images, np.ndarray) and images.ndim == 4
        ):
            raise TypeError("embed_images takes a sequence of images (or an NxHxWx3 array)")
        await self.start()
        out = empty(len(images), self._engine.dim)
        errors: dict[int, str] = {}

        async def batch(start: int, stop: int) -> bool:
            loaded = await asyncio.to_thread(load_all, [images[i] for i in range(start, stop)])
            positions: list[int] = []
            payloads: list[Payload] = []
            for index, item in enumerate(loaded, start):
                if isinstance(item, Unusable):
                    errors[index] = item.reason
                else:
                    positions.append(index)
                    payloads.append(item)
            if payloads:
                done = await self._engine.embed_images(payloads)
                out[positions] = done.vectors
                errors.update((positions[p], why) for p, why in done.errors.items())
            return not (strict and errors)

        await self._batches(len(images), batch, "embedding images")
        return out, errors

    async def _batches(self, n: int, work: Work, label: str) -> None:
        """work(start, stop) over consecutive batches in order, `concurrency` at a time; once
        one returns False no new batch starts. The first exception cancels the rest."""
        size = self._engine.max_items
        starts = iter(range(0, n, size))
        progress = Progress(n, label, self._progress)
        stopped = False

        async def worker() -> None:
            nonlocal stopped
            while not stopped and (start := next(starts, None)) is not None:
                stop = min(start + size, n)
                if not await work(start, stop):
                    stopped = True
                progress.advance(stop - start)

        tasks = [asyncio.create_task(worker()) for _ in range(min(self._concurrency, n))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            progress.close()
