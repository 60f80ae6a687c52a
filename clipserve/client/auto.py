"""Auto mode: the service when it is ready, else the model in-process. `AutoEngine` probes
GET /readyz once at start; if the service goes away later (ServerGone after retries) it loads
the local model and finishes there, for the rest of the client's life. Each switch logs one
warning. Embeddings of two different models never mix in one run: if the local model is not
the one the service ran (its identity, name/weights), the switch is refused."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from clipserve.client.engine import Embedded, Engine, Mode
from clipserve.client.errors import ClientError, ServerGone
from clipserve.client.inputs import Payload
from clipserve.client.local import LocalEngine
from clipserve.client.remote import RemoteEngine

log = logging.getLogger("clipserve.client")
T = TypeVar("T")


class AutoEngine:
    def __init__(self, remote: RemoteEngine, local: LocalEngine) -> None:
        self._remote = remote
        self._local = local
        self._active: Engine = remote
        self._served: str | None = None  # the service's model identity, once it has answered
        self._switching = asyncio.Lock()

    @property
    def mode(self) -> Mode:
        return self._active.mode

    @property
    def dim(self) -> int:
        return self._active.dim

    @property
    def max_items(self) -> int:
        return self._active.max_items

    async def start(self) -> None:
        why = "GET /readyz did not answer 200"
        if await self._remote.ready():
            try:
                await self._remote.start()
            except ServerGone as e:
                why = str(e)
            else:
                self._served = str(self._remote.card["model"])
                return
        log.warning(
            "clipserve service at %s unavailable (%s): embedding locally", self._remote.url, why
        )
        await self._go_local()

    async def _go_local(self) -> None:
        await self._local.start()
        self._active = self._local

    async def _switch(self, gone: ServerGone) -> None:
        async with self._switching:
            if self._active is self._local:  # another batch switched first
                return
            log.warning(
                "clipserve service at %s went away (%s): finishing locally", self._remote.url, gone
            )
            await self._local.start()
            if self._served is not None and self._local.identity != self._served:
                raise ClientError(
                    f"the service ran {self._served} and the local model is "
                    f"{self._local.identity}: not mixing their embeddings"
                ) from gone
            # The remote stays open until aclose: batches still retrying on it end in
            # ServerGone, and come here.
            self._active = self._local

    async def _run(self, call: Callable[[Engine], Awaitable[T]]) -> T:
        if self._active is self._remote:
            try:
                return await call(self._remote)
            except ServerGone as e:
                await self._switch(e)
        return await call(self._local)

    async def embed_images(self, payloads: Sequence[Payload]) -> Embedded:
        return await self._run(lambda engine: engine.embed_images(payloads))

    async def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        return await self._run(lambda engine: engine.embed_texts(texts))

    async def info(self) -> dict[str, Any]:
        return await self._run(lambda engine: engine.info())

    async def aclose(self) -> None:
        await self._remote.aclose()
        await self._local.aclose()
