"""`--decode gpu` on several devices: each device's batches decode in a process of its own.

torchvision keeps one nvJPEG decoder per process and rebuilds it, leaking the old one, whenever
the device changes (`nvjpeg.py`), so one process cannot decode on two GPUs. With several
devices, each gets a spawned child that owns that device's decoder (a `DeviceDecoder`, the same
one a single device uses in the engine's own process) and nothing else of CUDA. The device
thread sends a batch's encoded bytes over a pipe and blocks for its answer, as it would on an
in-process decode; the crops come back as a tensor on the device: torch's CUDA IPC on a GPU,
shared memory on the CPU, where the tests run these same lines with simulated devices.

The child finishes its device work before it answers (the parent has no stream to wait on
across processes), and the parent owns the tensor it receives like any other: torch keeps the
child's memory alive until the parent lets go of it. A child that dies fails its device's
worker as a lost device would (`ExecutorFatal`): `/readyz` reports it.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Literal

import torch

from clipserve.backends.torch_device import device_layer
from clipserve.config import LimitsConfig
from clipserve.errors import ExecutorFatal, StartupError
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec

if TYPE_CHECKING:
    from clipserve.inference.gpu_decode import DecodedBatch

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # a child imports torch and torchvision and makes a CUDA context
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _Reply:
    kind: Literal["ready", "decoded", "failed"]
    batch: DecodedBatch | None = None
    error: str = ""  # "failed": why, in one line (start-up, or an unexpected decode error)


class DecodeProcess:
    """A `DeviceDecoder` for `device` in a child process, with the same `device` and `decode`.

    Call `decode` from one thread (the device's worker thread); `close` ends the child."""

    def __init__(self, spec: PreprocessSpec, limits: LimitsConfig, device: str) -> None:
        """Starts the child; `wait_ready` waits for its decoder (start several, then wait)."""
        from clipserve.inference.nvjpeg import indexed

        self.device = indexed(device)
        # spawn: a forked child would inherit the parent's CUDA state, which CUDA forbids.
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child, spec, limits, str(self.device)),
            name=f"clipserve-decode-{self.device}",
            daemon=True,  # never outlives the engine
        )
        self._process.start()
        child.close()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Returns once the child's decoder is built; StartupError (child ended) if it fails."""
        try:
            reply = self._receive(timeout_s, "start")
        except ExecutorFatal as exc:
            self.close()
            raise StartupError(f"--decode gpu: {exc}") from None
        if reply.kind != "ready":
            self.close()
            raise StartupError(f"--decode gpu: the decode process for {self.device}: {reply.error}")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def decode(self, images: Sequence[bytes]) -> DecodedBatch:
        """As `DeviceDecoder.decode`; ExecutorFatal once the child is gone."""
        try:
            self._conn.send(list(images))
        except (OSError, ValueError):  # a closed or broken pipe
            raise ExecutorFatal(f"the decode process for {self.device} is gone") from None
        reply = self._receive(None, "decode")
        if reply.kind == "failed" or reply.batch is None:
            raise RuntimeError(f"decode process for {self.device}: {reply.error}")
        return reply.batch

    def _receive(self, timeout_s: float | None, what: str) -> _Reply:
        """The child's next reply; ExecutorFatal when it dies (or, at start, is too slow)."""
        while not self._conn.poll(1.0 if timeout_s is None else min(timeout_s, 1.0)):
            if not self._process.is_alive():
                code = self._process.exitcode
                raise ExecutorFatal(
                    f"the decode process for {self.device} exited ({code}) during {what}"
                )
            if timeout_s is not None:
                timeout_s -= 1.0
                if timeout_s <= 0:
                    raise ExecutorFatal(f"the decode process for {self.device} did not {what}")
        try:
            reply: _Reply = self._conn.recv()
        except (EOFError, OSError):
            raise ExecutorFatal(f"the decode process for {self.device} is gone") from None
        return reply

    def close(self) -> None:
        """End the child: it stops at the end of its pipe (idempotent)."""
        self._conn.close()
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(STOP_TIMEOUT_S)


def _serve(conn: Connection, spec: PreprocessSpec, limits: LimitsConfig, device: str) -> None:
    """The child: one decoder for `device`, answering each batch in order until its pipe ends."""
    from clipserve.backends.device import select_device
    from clipserve.inference.gpu_decode import DeviceDecoder

    try:
        select_device(device)
        decoder = DeviceDecoder(ImageDecoder.from_limits(spec, limits), device)
        layer = device_layer(torch.device(device))
    except Exception as exc:  # StartupError's message, or the library's
        conn.send(_Reply("failed", error=str(exc) or type(exc).__name__))
        return
    conn.send(_Reply("ready"))
    while (encoded := _next(conn)) is not None:
        try:
            batch = decoder.decode(encoded)
            # The parent has no stream of ours to wait on: the crops are final before they go.
            layer.current().synchronize()
        except Exception as exc:
            log.exception("decode process for %s: a batch failed", device)
            conn.send(_Reply("failed", error=f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(_Reply("decoded", batch))
        del batch  # torch holds the memory until the parent lets go of its view


def _next(conn: Connection) -> list[bytes] | None:
    """The next batch's bytes; None once the parent has closed its end (or is gone)."""
    try:
        encoded: list[bytes] = conn.recv()
    except (EOFError, OSError):
        return None
    return encoded
