"""The model in-process: `LocalEngine` builds the server's own runtime (config, model loading,
the torch executor warmed up, the image decoder) on this machine's CPU or GPU, and embeds as a
served batch is embedded (decode and crop, executor, L2 normalisation on the host), so its
vectors match the service's within the executor's tolerance."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from clipserve.backends.base import l2_normalise_rows
from clipserve.client.engine import Embedded, Mode, empty
from clipserve.client.errors import ClientError
from clipserve.client.inputs import Payload, Unusable, crop
from clipserve.client.wire import blamed_item
from clipserve.config import load_config
from clipserve.errors import ClipserveError, StartupError
from clipserve.http.info import info_card
from clipserve.http.names import ServedNames
from clipserve.inference.runtime import Runtime, build_runtime
from clipserve.protocol.text import check_length

T = TypeVar("T")


class LocalEngine:
    """`start` loads and warms up the model (seconds: run it once per process)."""

    mode: Mode = "local"

    def __init__(
        self,
        *,
        model: str = "ViT-B-32",
        pretrained: str = "laion2b_s34b_b79k",
        checkpoint: str | None = None,
        batch_size: int = 32,
        device: str = "cpu",
        threads: int = 0,
    ) -> None:
        flags: dict[str, str | list[str] | None] = {
            "model": model,
            "pretrained": pretrained,
            "checkpoint": checkpoint,
            "backend": "torch",
            "gpus": device,
            "threads": str(threads),
            "max_batch_size": str(batch_size),
            "max_queue_size": str(max(batch_size, 256)),
        }
        self._flags = flags
        self._batch_size = batch_size
        self._runtime: Runtime | None = None
        # Decoding competes with torch's threads for the same cores: half of them.
        self._pool = ThreadPoolExecutor(
            max(1, (os.cpu_count() or 1) // 2), thread_name_prefix="clipserve-local-decode"
        )

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise RuntimeError("LocalEngine.start() has not run")
        return self._runtime

    @property
    def dim(self) -> int:
        return self.runtime.model.embed_dim

    @property
    def max_items(self) -> int:
        return self._batch_size

    @property
    def identity(self) -> str:
        return self.runtime.model.identity

    async def start(self) -> None:
        if self._runtime is not None:
            return
        try:
            config = load_config(self._flags, environ={})  # the server's variables are not ours
            self._runtime = await asyncio.to_thread(build_runtime, config)
        except StartupError as e:
            raise ClientError(f"local model: {e}") from None

    async def _on(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def embed_images(self, payloads: Sequence[Payload]) -> Embedded:
        runtime = self.runtime
        out = Embedded(empty(len(payloads), self.dim))
        crops = await asyncio.gather(
            *(self._on(self._pool, crop, runtime.decoder, p) for p in payloads),
            return_exceptions=True,
        )
        good: list[int] = []
        arrays: list[np.ndarray] = []
        for i, result in enumerate(crops):
            if isinstance(result, Unusable):
                out.errors[i] = result.reason
            elif isinstance(result, BaseException):
                raise result
            else:
                good.append(i)
                arrays.append(result)
        if good:
            batch = np.stack(arrays)
            executor = runtime.executors[0]
            raw = await self._on(runtime.threads[0], executor.run, batch)
            out.vectors[good] = l2_normalise_rows(raw, np.ones(len(good), dtype=bool))
        for i in good:
            if not np.isfinite(out.vectors[i]).all():  # the server refuses these too (422)
                out.errors[i] = "the model's output for this input is not finite"
                out.vectors[i] = np.nan
        return out

    async def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        runtime = self.runtime
        limits = runtime.config.limits
        listed = list(texts)

        def tokenize() -> np.ndarray:
            try:
                checked = [
                    check_length(t, i, limits.max_text_chars, limits.truncate_text)
                    for i, t in enumerate(listed)
                ]
                return runtime.tokenize(checked, truncate=limits.truncate_text)
            except ClipserveError as e:
                position, reason = blamed_item(e.message)
                raise Unusable(reason, position or 0) from None

        tokens = await self._on(self._pool, tokenize)
        executor = runtime.text_executors[0]
        raw = await self._on(runtime.text_threads[0], executor.run, tokens)
        return l2_normalise_rows(raw, np.ones(len(listed), dtype=bool))

    async def info(self) -> dict[str, Any]:
        runtime = self.runtime
        config = runtime.config
        return info_card(
            runtime,
            config,
            ServedNames.of(config.model, runtime.model.name, runtime.model.identity),
        )

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._runtime is not None:
            runtime, self._runtime = self._runtime, None
            await asyncio.to_thread(runtime.close)
