"""`Client`: `AsyncClient`'s API as plain calls. It owns a private event loop on a daemon thread
and runs the async client there, so both share one implementation (batching, retries,
fallback) and the sync one works where the caller already runs an event loop (a notebook)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
import numpy as np

from clipserve.client.async_client import DEFAULT_URL, AsyncClient, ClientMode
from clipserve.client.engine import Embedded, Mode
from clipserve.client.inputs import ImageInput
from clipserve.client.remote import ImageFormat

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever on its own thread, until `close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="clipserve-client-loop", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C in the caller: the work on the loop stops too
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Client:
    """The sync client; a context manager, or call `close()` at the end. Arguments as
    `AsyncClient`'s. Construction connects (or loads the local model), so `mode_in_use` is
    known at once. Safe to share between threads: `concurrency` bounds their requests in
    flight together."""

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
        async def build() -> AsyncClient:
            # Made on the loop that will run it: httpx's pool belongs to one loop.
            client = AsyncClient(
                url,
                mode=mode,
                model=model,
                pretrained=pretrained,
                checkpoint=checkpoint,
                api_key=api_key,
                batch_size=batch_size,
                concurrency=concurrency,
                timeout_s=timeout_s,
                retries=retries,
                progress=progress,
                image_format=image_format,
                device=device,
                transport=transport,
            )
            try:
                await client.start()
            except BaseException:
                await client.aclose()
                raise
            return client

        self._loop = _LoopThread()
        try:
            self._client = self._loop.run(build())
        except BaseException:
            self._loop.close()
            raise
        self._closed = False

    @property
    def mode(self) -> ClientMode:
        return self._client.mode

    @property
    def mode_in_use(self) -> Mode:
        return self._client.mode_in_use

    def embed_images(self, images: Sequence[ImageInput]) -> np.ndarray:
        """See `AsyncClient.embed_images`."""
        return self._loop.run(self._client.embed_images(images))

    def embed_images_checked(self, images: Sequence[ImageInput]) -> Embedded:
        """See `AsyncClient.embed_images_checked`."""
        return self._loop.run(self._client.embed_images_checked(images))

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        return self._loop.run(self._client.embed_texts(texts))

    def info(self) -> dict[str, Any]:
        return self._loop.run(self._client.info())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._client.aclose())
        finally:
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
