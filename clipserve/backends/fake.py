"""A fake executor registered like the real ones: deterministic embeddings, no model, no device.

It lets end-to-end tests exercise the batcher, the HTTP edge and failure handling without a
GPU. Options (`--backend-option KEY=VALUE`):
  latency_ms       sleep per batch (simulates device time)
  per_item_ms      extra sleep per image
  fail_pixel       raise for a batch holding an image whose top-left red value equals this
  fatal_pixel      as fail_pixel, but raise ExecutorFatal (the device is lost)
  nan_pixel        the embedding of an image whose top-left red value equals this is all NaN
  hang_pixel       a batch holding such an image never finishes (a device call that does not
                   return): until the executor is closed, then it fails
  oom_above        raise an out-of-memory RuntimeError, as torch does, for batches larger than this
  compute          0: skip the per-image features; each embedding is a row of a fixed table chosen
                   by the image's first value, so benchmarks measure the server, not the fake
  stream           1: a simulated GPU stream for the pipelined worker (--pipeline-depth 2 or
                   more): batches are launched and complete asynchronously, see below
  perturb          relative noise added to every image embedding (e.g. 0.1: cosine ~0.995 to
                   the unperturbed one): a backend computing wrong numbers, for the self-check
  fail_text        the text tower's fail_pixel: raise for a batch holding exactly this text
  fatal_text       as fail_text, but raise ExecutorFatal (the text tower's device is lost)
  nan_text         the embedding of exactly this text is all NaN
Each `sim:N` device in `--gpus` gets its own instance, so multi-worker dispatch runs anywhere.

The text tower is faked too (`FakeTextExecutor`): embeddings are a fixed function of the token
ids, so a text always gets the same embedding and no model runs. latency_ms, per_item_ms,
oom_above and compute apply to it as to images; stream does not (its worker is synchronous).

With `stream=1` the fake is a simulated GPU for the pipelined worker: `launch` stacks the batch
on the caller's thread (the host's share) and queues it on one "stream" thread per executor,
which sleeps (releasing the GIL, as a kernel would) and computes; batches finish in launch
order, each its latency after the previous one. `run` keeps the synchronous behaviour, and
without `stream` the fake is synchronous throughout (tests that hold one batch on the device
with latency_ms and expect the next to wait in the queue rely on that).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from clipserve.backends.base import (
    ExecutorInfo,
    ExecutorSpec,
    check_batch,
    check_tokens,
    l2_normalise_rows,
    normalisation_affine,
)
from clipserve.backends.stacking import stack
from clipserve.errors import ExecutorFatal, StartupError

if TYPE_CHECKING:
    from clipserve.inference.model import LoadedModel
    from clipserve.inference.preprocess import PreprocessSpec

_GRID = 4  # features are per-channel means over a 4x4 grid of cells
_TOKEN_ROWS = 4096  # the fake text tower's table: one row per (token id, position) mod this


def unavailable_reason(backend: str, device: str) -> str:
    return "a fake: only on request"  # never picked by --backend auto


class FakeExecutor:
    def __init__(
        self,
        spec: PreprocessSpec,
        embed_dim: int,
        device: str = "sim:0",
        *,
        latency_ms: float = 0.0,
        per_item_ms: float = 0.0,
        fail_pixel: int | None = None,
        fatal_pixel: int | None = None,
        nan_pixel: int | None = None,
        hang_pixel: int | None = None,
        oom_above: int | None = None,
        compute: bool = True,
        stream: bool = False,
        perturb: float = 0.0,
    ) -> None:
        self.compute = compute
        self.perturb = perturb
        self.asynchronous = stream  # a simulated GPU stream: launch/wait overlap batches
        self.spec = spec
        self.latency_s = latency_ms / 1000
        self.per_item_s = per_item_ms / 1000
        self.fail_pixel = fail_pixel
        self.fatal_pixel = fatal_pixel
        self.nan_pixel = nan_pixel
        self.hang_pixel = hang_pixel
        self._closing = threading.Event()  # what a hung batch waits for
        self.oom_above = oom_above
        self.info = ExecutorInfo("fake", device, "fp32", spec.size, embed_dim)
        rng = np.random.default_rng(0)
        self._proj = rng.standard_normal((3 * _GRID * _GRID, embed_dim)).astype(np.float32)
        self._lock = threading.Lock()
        self.batches: list[int] = []  # sizes of the batches run, in order (tests read this)
        self.attempts: list[int] = []  # sizes of every call to run(), failed ones included
        self.closed = False
        self._stream: ThreadPoolExecutor | None = None  # the simulated device, made on first use

    @property
    def items_run(self) -> int:
        with self._lock:
            return sum(self.batches)

    def forget_runs(self) -> None:
        """Empty `batches` and `attempts`: tests count from here (after start-up's runs)."""
        with self._lock:
            self.batches.clear()
            self.attempts.clear()

    def features(self, batch: np.ndarray) -> np.ndarray:
        """(N, 48) per-channel means over a 4x4 grid of the normalised image. Normalisation is
        affine, so uint8 cells are averaged first and only the 48 means normalised: the fake
        costs the same for every input kind, and protocol benchmarks measure the protocol."""
        n = batch.shape[0]
        if batch.dtype == np.uint8:
            _, h, w, c = batch.shape
            crop = batch[:, : h - h % _GRID, : w - w % _GRID, :]
            means = crop.reshape(n, _GRID, h // _GRID, _GRID, w // _GRID, c).mean(axis=(2, 4))
            scale, bias = normalisation_affine(self.spec)
            cells = (means * scale + bias).transpose(0, 3, 1, 2)
        else:
            _, c, h, w = batch.shape
            crop = batch[:, :, : h - h % _GRID, : w - w % _GRID]
            cells = crop.reshape(n, c, _GRID, h // _GRID, _GRID, w // _GRID).mean(
                axis=(3, 5), dtype=np.float64
            )
        features: np.ndarray = cells.reshape(n, -1).astype(np.float32)
        return features

    def run(self, batch: np.ndarray) -> np.ndarray:
        check_batch(batch, self.spec)
        with self._lock:
            self.attempts.append(len(batch))
        return self._device(batch)

    def launch(self, arrays: Sequence[np.ndarray], normalize: np.ndarray) -> object:
        batch = stack(arrays)  # the host's share of a batch: assembling it, as the real ones do
        check_batch(batch, self.spec)
        with self._lock:
            self.attempts.append(len(batch))
        if self._stream is None:
            self._stream = ThreadPoolExecutor(1, thread_name_prefix=f"fake-{self.info.device}")
        return self._stream.submit(self._launched, batch, normalize.copy())

    def wait(self, launched: object) -> np.ndarray:
        assert isinstance(launched, Future)
        out: np.ndarray = launched.result()
        return out

    def _launched(self, batch: np.ndarray, normalize: np.ndarray) -> np.ndarray:
        return l2_normalise_rows(self._device(batch), normalize)  # "on the device"

    def _device(self, batch: np.ndarray) -> np.ndarray:
        """The simulated device's work: its latency, then the embeddings or the failure."""
        time.sleep(self.latency_s + self.per_item_s * len(batch))
        if batch.dtype == np.uint8:
            marks = batch[:, 0, 0, 0].tolist()
            if self.fatal_pixel is not None and self.fatal_pixel in marks:
                raise ExecutorFatal(f"simulated device loss on {self.info.device}")
            if self.fail_pixel is not None and self.fail_pixel in marks:
                raise RuntimeError(f"simulated executor failure on {self.info.device}")
            if self.hang_pixel is not None and self.hang_pixel in marks:
                self._closing.wait()
                raise RuntimeError(f"simulated hung batch on {self.info.device}: closed")
        if self.oom_above is not None and len(batch) > self.oom_above:
            raise RuntimeError(f"CUDA out of memory (simulated on {self.info.device})")
        with self._lock:
            self.batches.append(len(batch))
        out: np.ndarray
        if self.compute:
            out = self.features(batch) @ self._proj
        else:  # O(1) per image: a row picked by the first value
            first = batch.reshape(len(batch), -1)[:, 0].astype(np.int64) % len(self._proj)
            out = self._proj[first].copy()
        if self.nan_pixel is not None and batch.dtype == np.uint8:
            out[batch[:, 0, 0, 0] == self.nan_pixel] = np.nan
        if self.perturb:  # noise of `perturb` times each row's norm, spread over its values
            scale = self.perturb * np.linalg.norm(out, axis=1, keepdims=True) / out.shape[1] ** 0.5
            noise = np.random.default_rng(len(out)).standard_normal(out.shape)
            out = (out + scale * noise).astype(np.float32)
        return out

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        h, w = self.spec.size
        for n in batch_sizes:
            self.features(np.zeros((n, h, w, 3), dtype=np.uint8))

    def memory(self) -> int | None:
        return None

    def close(self) -> None:
        self.closed = True
        self._closing.set()
        if self._stream is not None:  # batches still queued on the simulated device are dropped
            self._stream.shutdown(wait=False, cancel_futures=True)


class FakeTextExecutor:
    """The text tower without a model: int64 token ids (N, context_length) → float32
    (N, embed_dim), the sum of fixed random rows picked by each token id and its position (with
    compute=0, one row picked by the first token after the start token). Texts given as markers
    fail their batch, lose the device, or come back NaN, as marker pixels do for images."""

    def __init__(
        self,
        context_length: int,
        embed_dim: int,
        device: str = "sim:0",
        *,
        latency_ms: float = 0.0,
        per_item_ms: float = 0.0,
        fail: np.ndarray | None = None,
        fatal: np.ndarray | None = None,
        nan: np.ndarray | None = None,
        oom_above: int | None = None,
        compute: bool = True,
    ) -> None:
        self.context_length = context_length
        self.latency_s = latency_ms / 1000
        self.per_item_s = per_item_ms / 1000
        # Markers are whole token rows (a text as the tokenizer gives it), compared as bytes.
        self.fail, self.fatal, self.nan = (
            None if row is None else row.astype(np.int64).tobytes() for row in (fail, fatal, nan)
        )
        self.oom_above = oom_above
        self.compute = compute
        self.info = ExecutorInfo("fake-text", device, "fp32", (0, 0), embed_dim)
        rng = np.random.default_rng(1)
        self._table = rng.standard_normal((_TOKEN_ROWS, embed_dim)).astype(np.float32)
        self._position = np.arange(context_length, dtype=np.int64) * 7919  # a prime stride
        self._lock = threading.Lock()
        self.batches: list[int] = []  # sizes of the batches run, in order (tests read this)
        self.attempts: list[int] = []  # sizes of every call to run(), failed ones included
        self.closed = False

    def forget_runs(self) -> None:
        """Empty `batches` and `attempts`: tests count from here (after start-up's runs)."""
        with self._lock:
            self.batches.clear()
            self.attempts.clear()

    def run(self, batch: np.ndarray) -> np.ndarray:
        check_tokens(batch, self.context_length)
        with self._lock:
            self.attempts.append(len(batch))
        time.sleep(self.latency_s + self.per_item_s * len(batch))
        rows = [row.tobytes() for row in batch]
        if self.fatal is not None and self.fatal in rows:
            raise ExecutorFatal(f"simulated device loss on {self.info.device} (text)")
        if self.fail is not None and self.fail in rows:
            raise RuntimeError(f"simulated executor failure on {self.info.device} (text)")
        if self.oom_above is not None and len(batch) > self.oom_above:
            raise RuntimeError(f"CUDA out of memory (simulated on {self.info.device})")
        with self._lock:
            self.batches.append(len(batch))
        out = self._embed(batch)
        if self.nan is not None:
            out[[row == self.nan for row in rows]] = np.nan
        return out

    def _embed(self, batch: np.ndarray) -> np.ndarray:
        out: np.ndarray
        if not self.compute:  # O(1) per text
            out = self._table[batch[:, min(1, self.context_length - 1)] % _TOKEN_ROWS]
            return out
        picked = self._table[(batch + self._position) % _TOKEN_ROWS]  # (N, L, dim)
        out = (picked * (batch != 0)[:, :, None]).sum(axis=1, dtype=np.float32)
        return out

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        for n in batch_sizes:  # the embedding only: warm-up never sleeps or fails
            self._embed(np.zeros((n, self.context_length), dtype=np.int64))

    def memory(self) -> int | None:
        return None

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class FakeOptions:
    """`--backend-option`s, parsed and checked once for both towers."""

    latency_ms: float = 0.0
    per_item_ms: float = 0.0
    fail_pixel: int | None = None
    fatal_pixel: int | None = None
    nan_pixel: int | None = None
    hang_pixel: int | None = None
    oom_above: int | None = None
    compute: bool = True
    stream: bool = False
    perturb: float = 0.0
    fail_text: str | None = None
    fatal_text: str | None = None
    nan_text: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> FakeOptions:
        known = set(cls.__dataclass_fields__)
        unknown = set(options) - known
        if unknown:
            raise StartupError(
                f"--backend-option: the fake backend has no option {sorted(unknown)}"
            )

        def whole(key: str) -> int | None:
            value = _number(options, key)
            return None if value is None else int(value)

        return cls(
            latency_ms=_number(options, "latency_ms") or 0.0,
            per_item_ms=_number(options, "per_item_ms") or 0.0,
            fail_pixel=whole("fail_pixel"),
            fatal_pixel=whole("fatal_pixel"),
            nan_pixel=whole("nan_pixel"),
            hang_pixel=whole("hang_pixel"),
            oom_above=whole("oom_above"),
            compute=_number(options, "compute") != 0,
            stream=bool(_number(options, "stream")),
            perturb=_number(options, "perturb") or 0.0,
            fail_text=options.get("fail_text"),
            fatal_text=options.get("fatal_text"),
            nan_text=options.get("nan_text"),
        )


def _number(options: Mapping[str, str], key: str) -> float | None:
    if key not in options:
        return None
    try:
        return float(options[key])
    except ValueError:
        raise StartupError(f"--backend-option {key}: expected a number") from None


def create(model: LoadedModel, spec: ExecutorSpec, device: str) -> FakeExecutor:
    o = FakeOptions.parse(spec.options)
    return FakeExecutor(
        model.preprocess,
        model.embed_dim,
        device,
        latency_ms=o.latency_ms,
        per_item_ms=o.per_item_ms,
        fail_pixel=o.fail_pixel,
        fatal_pixel=o.fatal_pixel,
        nan_pixel=o.nan_pixel,
        hang_pixel=o.hang_pixel,
        oom_above=o.oom_above,
        compute=o.compute,
        stream=o.stream,
        perturb=o.perturb,
    )


def create_text(model: LoadedModel, spec: ExecutorSpec, device: str) -> FakeTextExecutor:
    o = FakeOptions.parse(spec.options)

    def marker(text: str | None) -> np.ndarray | None:
        return None if text is None else model.tokenize([text])[0]

    return FakeTextExecutor(
        model.context_length,
        model.embed_dim,
        device,
        latency_ms=o.latency_ms,
        per_item_ms=o.per_item_ms,
        fail=marker(o.fail_text),
        fatal=marker(o.fatal_text),
        nan=marker(o.nan_text),
        oom_above=o.oom_above,
        compute=o.compute,
    )
