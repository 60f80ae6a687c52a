"""What torchvision's nvJPEG decode asks of its callers, kept in one place.

Read in torchvision's source (csrc/io/image/cuda/decode_jpegs_cuda.cpp, 0.29):
- one `CUDAJpegDecoder` per process, behind a mutex, rebuilt whenever the call's `device=`
  differs from the last call's; the old one's destructor frees nothing (its body is commented
  out), so every switch leaks its nvJPEG handle, pinned and device buffers. Two GPUs decoding in
  one process would take turns and leak on each turn. `NvjpegOwner` gives nvJPEG to one CUDA
  device per process and refuses a second at start-up; device names are always indexed, since
  "cuda" and "cuda:0" compare unequal there and would rebuild it too.
- outputs are allocated (`torch::empty`) on the caller's current stream and written on the
  decoder's own pool stream, which waits for nothing of the caller's. Memory freed on the
  caller's stream while kernels queued there still read it (an earlier chunk, a resize
  intermediate) could be handed to the next call's outputs and overwritten under those
  kernels. `DecodeStreams` makes a stream of ours current during each call, so outputs come from
  that stream's pool only, and records each output on the stream that reads it
  (`record_stream`): the allocator reuses an output's memory only once its readers are done.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from clipserve.backends.device import cuda_index
from clipserve.errors import StartupError


def indexed(device: str | torch.device) -> torch.device:
    """`device` as torchvision should see it: "cuda" is "cuda:0" (device.py's convention)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", cuda_index("cuda"))
    return device


class NvjpegOwner:
    """Which CUDA device this process's nvJPEG decoder serves: the first to claim it, for good
    (torchvision's decoder lives as long as the process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.device: torch.device | None = None

    def claim(self, device: torch.device) -> None:
        if device.type != "cuda":
            return  # libjpeg-turbo on the host: no process-wide state
        with self._lock:
            if self.device is None:
                self.device = device
            elif self.device != device:
                raise StartupError(
                    f"--decode gpu: {device} cannot decode in this process, {self.device} does "
                    "(torchvision keeps one nvJPEG decoder per process and rebuilds it, leaking "
                    "the old one, whenever the device changes); run one server per GPU with "
                    "--decode gpu, or --decode cpu"
                )


# torchvision's decoder is process-wide, so its owner is too; tests pass their own.
PROCESS_OWNER = NvjpegOwner()


class DecodeStreams(Protocol):
    """Stream discipline around one torchvision decode call (see the module docstring)."""

    def decoding(self) -> contextlib.AbstractContextManager[object]:
        """The context the decode call runs in."""
        ...

    def hand_over(self, outputs: Sequence[torch.Tensor]) -> None:
        """`outputs` are read from now on by work queued on the current stream."""
        ...

    def done(self) -> None:
        """The batch's reads of every output handed over are queued."""
        ...


class CudaDecodeStreams:
    """Outputs allocated from a stream of ours, recorded on the reader's stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None  # made on the first decode's thread

    @contextlib.contextmanager
    def decoding(self) -> Iterator[object]:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        reader = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            yield self.stream
        # torchvision made our stream wait for its decode; the reader waits for ours.
        reader.wait_stream(self.stream)

    def hand_over(self, outputs: Sequence[torch.Tensor]) -> None:
        reader = torch.cuda.current_stream(self.device)
        for tensor in outputs:
            tensor.record_stream(reader)

    def done(self) -> None:
        pass  # record_stream already holds each output's memory for its readers


class HostDecodeStreams:
    """The host's version of the same promise: work is synchronous, and each output handed over
    is held by reference until the batch is done, so the CPU tests watch the same calls made in
    the same order (tests/inference/test_gpu_decode.py)."""

    def __init__(self) -> None:
        self._held: list[Sequence[torch.Tensor]] = []

    def decoding(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def hand_over(self, outputs: Sequence[torch.Tensor]) -> None:
        self._held.append(outputs)

    def done(self) -> None:
        self._held.clear()


def decode_streams(device: torch.device) -> DecodeStreams:
    if device.type == "cuda":
        return CudaDecodeStreams(device)
    return HostDecodeStreams()
