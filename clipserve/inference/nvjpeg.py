"""What torchvision's nvJPEG decode asks of its callers, kept in one place.

Read in torchvision's source (csrc/io/image/cuda/decode_jpegs_cuda.cpp, 0.29):
- one `CUDAJpegDecoder` per process, behind a mutex, rebuilt whenever the call's `device=`
  differs from the last call's; the old one's destructor frees nothing (its body is commented
  out), so every switch leaks its nvJPEG handle, pinned and device buffers. Two GPUs decoding in
  one process would take turns and leak on each turn. `NvjpegOwner` gives nvJPEG to one CUDA
  device per process and refuses a second at start-up (the runtime never asks: with several
  devices each decodes in a process of its own, `decode_process.py`); device names are always
  indexed, since "cuda" and "cuda:0" compare unequal there and would rebuild it too.
- outputs are allocated (`torch::empty`) on the caller's current stream and written on the
  decoder's own pool stream, which waits for nothing of the caller's. Memory freed on the
  caller's stream while kernels queued there still read it (an earlier chunk, a resize
  intermediate) could be handed to the next call's outputs and overwritten under those
  kernels. `DecodeStreams` makes a stream of ours current during each call, so outputs come from
  that stream's pool only, and records each output on the stream that reads it
  (`record_stream`): the allocator reuses an output's memory only once its readers are done.
  It does so through the device layer (`backends/torch_device.py`), whose CPU streams are real
  no-ops, so the CPU tests run these very lines.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from clipserve.backends.device import indexed_torch_device
from clipserve.backends.torch_device import DeviceLayer, Stream, device_layer
from clipserve.errors import StartupError


def indexed(device: str | torch.device) -> torch.device:
    """`device` as torchvision should see it: "cuda" is "cuda:0" (device.py's convention)."""
    return torch.device(indexed_torch_device(str(device)))


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
                    "the old one, whenever the device changes): a device's decoder belongs in "
                    "a process of its own (inference/decode_process.py)"
                )


# torchvision's decoder is process-wide, so its owner is too; tests pass their own.
PROCESS_OWNER = NvjpegOwner()


class DecodeStreams:
    """Stream discipline around torchvision's decode calls (see the module docstring), through
    the device layer: on CUDA, outputs allocated from a stream of ours and recorded on the
    reader's stream; on the CPU the same calls, whose streams have nothing to wait for. Either
    way each output handed over is also held by reference until the batch is done, so the CPU
    tests watch the same calls made in the same order (tests/inference/test_gpu_decode.py)."""

    def __init__(self, layer: DeviceLayer) -> None:
        self.layer = layer
        self.stream: Stream | None = None  # made on the first decode's thread
        self._held: list[Sequence[torch.Tensor]] = []

    @contextlib.contextmanager
    def decoding(self) -> Iterator[object]:
        """The context each decode call runs in."""
        if self.stream is None:
            self.stream = self.layer.stream()
        reader = self.layer.current()
        with self.layer.on(self.stream):
            yield self.stream
        # torchvision made our stream wait for its decode; the reader waits for ours.
        reader.wait_stream(self.stream)

    def hand_over(self, outputs: Sequence[torch.Tensor]) -> None:
        """`outputs` are read from now on by work queued on the current stream."""
        reader = self.layer.current()
        for tensor in outputs:
            self.layer.keep(tensor, reader)
        self._held.append(outputs)

    def done(self) -> None:
        """The batch's reads of every output handed over are queued (and `keep` guards their
        memory from then on)."""
        self._held.clear()


def decode_streams(device: torch.device) -> DecodeStreams:
    return DecodeStreams(device_layer(device))
