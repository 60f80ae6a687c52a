"""Batched JPEG decode on a torch device (nvJPEG through torchvision), resize and crop there too.

`DeviceDecoder` turns a batch of encoded images into uint8 NHWC crops on one device, for
`--decode gpu`: the device worker decodes the batch it is about to run, so only JPEG bytes cross
PCIe. The transform is open_clip's eval transform, as `preprocess.ImageDecoder`'s exact path
runs it (shorter side resized with antialiased bicubic, centre crop, RGB). torch's antialiased
bicubic uses Pillow's kernel (a = -0.5) and the two passes round to 8 bits as Pillow's do, so
the crops match open_clip's within a level (tests/inference/test_gpu_decode.py); JPEG draft mode
has no nvJPEG counterpart and is not used.

One image never fails its batch:
- the header checks are `ImageDecoder.open`'s (container walk, format, pixel and aspect limits),
  on the host before any pixel is decoded, so a refused image gets the CPU path's error;
- what nvJPEG should not take goes to the host decoder (`ImageDecoder`) from the header: PNG and
  WebP, CMYK/YCCK JPEGs (converted unlike Pillow), files whose data does not end in an EOI
  marker (truncated: Pillow refuses them, nvJPEG may decode garbage), images whose full-size
  resize exceeds `MAX_RESIZED_PIXELS` (the host resizes only the crop's region), JPEGs whose
  scans TurboJPEG cannot check (odd sampling factors: `jpeg.refusal` says "unsupported", not
  "corrupt", and Pillow decides, as on the CPU path);
- torchvision decodes a list all-or-nothing: when a chunk fails, it is halved until the images
  nvJPEG refuses are found, and each goes to the host decoder, which decodes it or names its
  error. A fatal device error raises `ExecutorFatal` instead (the worker must stop).

On `device="cpu"` the same code runs torchvision's libjpeg-turbo decode, so CPU tests exercise
every branch. torchvision 0.29 deprecates its decoders for TorchCodec's; the call is the same
there (`decode_jpeg` on a list with `device=`), so moving is a one-line change.

torchvision's nvJPEG path asks three things of its callers (inference/nvjpeg.py): one CUDA device
per process, outputs kept from reuse until their readers are done, and corrupt entropy-coded
data caught beforehand, since the hardware decoder checks headers only and can report
"success" on a corrupt scan. `check` therefore also runs libjpeg-turbo's entropy decode at 1/8
scale with its warnings as errors (simplejpeg, strict: about 1 ms per 640x480 image, a fifth of
the host decoder's work), so a corrupt JPEG gets its 400 at admission. Admission's answer
travels with the bytes (`EncodedAtAdmission`: a short tagged prefix), so the device thread does
not parse the header again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import struct
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags

from clipserve.backends.device import CPU, is_fatal_device_error
from clipserve.errors import ClipserveError, ExecutorFatal, StartupError
from clipserve.inference.jpeg import refusal
from clipserve.inference.nvjpeg import PROCESS_OWNER, NvjpegOwner, decode_streams, indexed
from clipserve.inference.preprocess import (
    MAX_RESIZED_PIXELS,
    ImageDecoder,
    center_box,
    resized_size,
)

# Pixels decoded by one torchvision call (uint8 RGB: 3 bytes each, so 384 MiB) and resized in
# one interpolate call (float32: 12 bytes each, 384 MiB): bounds device memory per batch.
MAX_DECODE_PIXELS = 1 << 27
MAX_RESIZE_PIXELS = 1 << 25
_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
# A JPEG checked at admission, as it travels to the device worker: this prefix, then its bytes.
# The tag's first byte is zero, so no checked image can be mistaken for a raw one or back.
_TAG = b"\x00CSJ"
_TAGGED = struct.Struct(">4sBIIB")  # tag, on_device, width, height, orientation


@dataclass(frozen=True)
class Header:
    """What the host's header checks learned about one image."""

    on_device: bool  # nvJPEG takes it; otherwise the host decoder does
    size: tuple[int, int]  # (width, height) as stored, before EXIF orientation
    orientation: int = 1  # EXIF orientation tag; 1 = as stored


@dataclass
class DecodedBatch:
    """A decoded batch: rows for the images that decoded, an error for each that did not."""

    pixels: torch.Tensor  # (len(ok), H, W, 3) uint8 on the decoder's device
    ok: list[int]  # input position of each row of `pixels`, ascending
    errors: dict[int, ClipserveError] = field(default_factory=dict)
    on_device: int = 0  # images the device's decoder decoded
    on_host: int = 0  # images the host decoder decoded (by format, or after a refusal)


def tagged(header: Header, data: bytes) -> bytes:
    """`data` with admission's header in front (`untagged` reads it back)."""
    width, height = header.size
    return _TAGGED.pack(_TAG, header.on_device, width, height, header.orientation) + data


def untagged(data: bytes) -> tuple[Header | None, bytes]:
    """(admission's header, the image's bytes); (None, data) for bytes without the tag."""
    if not data.startswith(_TAG) or len(data) < _TAGGED.size:
        return None, data
    _, on_device, width, height, orientation = _TAGGED.unpack_from(data)
    return Header(bool(on_device), (width, height), orientation), data[_TAGGED.size :]


def _ends_with_eoi(data: bytes) -> bool:
    # Some encoders pad with zero bytes after EOI; anything else after it goes to the host.
    return data[-32:].rstrip(b"\x00").endswith(b"\xff\xd9")


@contextlib.contextmanager
def _quiet_deprecation() -> Iterator[None]:
    # torchvision >= 0.29 warns on every decode call; pytest turns warnings into errors.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
        yield


def _orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply an EXIF orientation to a (C, H, W) tensor as `ImageOps.exif_transpose` does."""
    if orientation == 2:  # mirrored
        return image.flip(-1)
    if orientation == 3:  # upside down
        return image.flip(-2, -1)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:  # Pillow's TRANSPOSE
        return image.transpose(-2, -1)
    if orientation == 6:  # Pillow's ROTATE_270: a quarter turn clockwise
        return image.rot90(-1, (-2, -1))
    if orientation == 7:  # Pillow's TRANSVERSE
        return image.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:  # Pillow's ROTATE_90: a quarter turn anticlockwise
        return image.rot90(1, (-2, -1))
    return image  # 1 and values Pillow ignores


class BatchDecoder(Protocol):
    """What a device worker decodes with: a `DeviceDecoder`, or its twin in a process of its
    own (`decode_process.DecodeProcess`, one per device when there are several)."""

    @property
    def device(self) -> torch.device: ...

    def decode(self, images: Sequence[bytes]) -> DecodedBatch: ...

    def close(self) -> None: ...


class DeviceDecoder:
    """Encoded images → uint8 NHWC crops on `device` ("cuda:N", or "cpu" for tests).

    `host` is the CPU decoder whose limits and spec apply; it also decodes every image the
    device decoder does not. Call `decode` from the device's own worker thread (its CUDA device
    selected); `check` is pure host work and may run anywhere, e.g. at admission.
    """

    def __init__(
        self,
        host: ImageDecoder,
        device: str | torch.device,
        *,
        max_decode_pixels: int = MAX_DECODE_PIXELS,
        max_resize_pixels: int = MAX_RESIZE_PIXELS,
        owner: NvjpegOwner = PROCESS_OWNER,
    ) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:  # by name: mypy's view of it stays pyproject's business
            simplejpeg = importlib.import_module("simplejpeg")
        except ImportError:
            raise StartupError(
                "--decode gpu needs simplejpeg to refuse corrupt JPEGs before nvJPEG sees them: "
                "pip install simplejpeg"
            ) from None
        self.host = host
        self.spec = host.spec
        self.device = indexed(device)
        owner.claim(self.device)  # before any CUDA work: a second GPU is refused here
        self._streams = decode_streams(self.device)
        self._scan = simplejpeg.decode_jpeg
        self.max_decode_pixels = max_decode_pixels
        self.max_resize_pixels = max_resize_pixels
        self._decode_jpeg = decode_jpeg
        self._rgb = ImageReadMode.RGB
        self._mode = self.spec.interpolation  # "bicubic" | "bilinear", checked by the spec
        # CUDA's antialiased kernels take floats only; the CPU's also take uint8.
        self.uint8_resize = self.device.type == "cpu"

    def close(self) -> None:
        """Nothing of its own to free: torchvision's decoder lives as long as the process."""

    def check(self, data: bytes) -> Header:
        """The host's header checks, and a JPEG's entropy-coded data; raises the ClipserveError
        the CPU path would (InvalidImage for corrupt data)."""
        img = self.host.open(data)
        width, height = img.size
        scanned = img.format == "JPEG" and self._check_scan(data, img.mode)
        if not scanned or img.mode not in ("RGB", "L") or not _ends_with_eoi(data):
            return Header(False, (width, height))
        try:
            orientation = int(img.getexif().get(ExifTags.Base.Orientation, 1))
        except (OSError, ValueError, SyntaxError, EOFError, TypeError):
            return Header(False, (width, height))  # the host decoder judges odd EXIF
        upright = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
        new_w, new_h = resized_size(*upright, self.spec)
        return Header(new_w * new_h <= MAX_RESIZED_PIXELS, (width, height), orientation)

    def _check_scan(self, data: bytes, mode: str) -> bool:
        """libjpeg-turbo's Huffman decode of every scan at 1/8 scale (the IDCT and colour work
        nearly vanish), its "corrupt data" warnings raised as errors: truncated scans, bad
        Huffman codes, stray markers. Same memory as the host's decode of a progressive JPEG
        (every coefficient), which `ImageDecoder.open`'s pixel limit bounds. False where
        TurboJPEG cannot take the file (odd sampling factors): not refused, as on the CPU path
        (`jpeg.refusal`), but unchecked, so it goes to the host decoder (Pillow decides), not to
        nvJPEG."""
        space = "CMYK" if mode == "CMYK" else "GRAY"
        try:
            self._scan(data, colorspace=space, min_height=1, min_width=1, min_factor=8)
        except (ValueError, RuntimeError) as e:
            refused = refusal(e)
            if refused is not None:
                raise refused from None
            return False
        return True

    def checked(self, data: bytes) -> Header | ClipserveError:
        try:
            return self.check(data)
        except ClipserveError as e:
            return e

    def decode(
        self,
        images: Sequence[bytes],
        *,
        headers: Sequence[Header | ClipserveError] | None = None,
        out: torch.Tensor | None = None,
        pool: concurrent.futures.Executor | None = None,
    ) -> DecodedBatch:
        """Decode, resize and crop `images`; rows come back in input order, failures dropped.

        `headers` are `checked`'s answers if the caller ran the checks already (at admission);
        `out` is an (N >= len(images), H, W, 3) uint8 staging buffer on the device to fill (rows
        0..len(ok)-1 hold the result); `pool` runs host decodes beside the device's work.
        """
        n = len(images)
        th, tw = self.spec.size
        out = self._staging(out, n, th, tw)
        if headers is None:  # admission's answers where they came with the bytes
            found = [untagged(data) for data in images]
            images = [data for _, data in found]
            headers = [h or self.checked(data) for h, data in found]
        if len(headers) != n:
            raise ValueError(f"{len(headers)} headers for {n} images")
        errors: dict[int, ClipserveError] = {}
        device_items: list[int] = []
        host_items: list[int] = []
        for i, header in enumerate(headers):
            if isinstance(header, ClipserveError):
                errors[i] = header
            elif header.on_device:
                device_items.append(i)
            else:
                host_items.append(i)
        # Host decodes start first so that, given a pool, they overlap the device's work.
        pending = {i: pool.submit(self.host, images[i]) for i in host_items} if pool else {}
        refused = self._decode_on_device(images, headers, device_items, out)
        on_host = 0
        for i in [*host_items, *refused]:
            try:
                crop = pending[i].result() if i in pending else self.host(images[i])
            except ClipserveError as e:
                errors[i] = e
                continue
            self._upload(crop, out[i])
            on_host += 1
        ok = [i for i in range(n) if i not in errors]
        for row, i in enumerate(ok):  # compact: rows 0..len(ok)-1 in input order
            if row != i:  # rows only move up: each source is read before it is overwritten
                out[row].copy_(out[i])
        self._streams.done()
        return DecodedBatch(
            pixels=out[: len(ok)],
            ok=ok,
            errors=errors,
            on_device=len(device_items) - len(refused),
            on_host=on_host,
        )

    def _upload(self, crop: np.ndarray, row: torch.Tensor) -> None:
        """A host crop into its row; on CUDA through pinned memory, so the copy queues on the
        stream instead of waiting for it (a pageable copy synchronises the stream)."""
        host = torch.tensor(crop)  # a copy: the host crop is read-only
        if row.is_cuda:
            host = host.pin_memory()
        row.copy_(host, non_blocking=row.is_cuda)

    def _staging(self, out: torch.Tensor | None, n: int, th: int, tw: int) -> torch.Tensor:
        if out is None:
            return torch.empty((n, th, tw, 3), dtype=torch.uint8, device=self.device)
        if out.dtype != torch.uint8 or out.shape[0] < n or tuple(out.shape[1:]) != (th, tw, 3):
            raise ValueError(f"staging buffer {tuple(out.shape)} {out.dtype} cannot hold {n} crops")
        same_index = None in (out.device.index, self.device.index) or (
            out.device.index == self.device.index
        )
        if out.device.type != self.device.type or not same_index:
            raise ValueError(f"staging buffer on {out.device}, decoder on {self.device}")
        return out

    def _decode_on_device(
        self,
        images: Sequence[bytes],
        headers: Sequence[Header | ClipserveError],
        items: list[int],
        out: torch.Tensor,
    ) -> list[int]:
        """Decode `items` in chunks of bounded pixels; returns the items the decoder refused."""
        refused: list[int] = []
        chunk: list[int] = []
        pixels = 0
        for i in items:
            header = headers[i]
            assert isinstance(header, Header)
            size = header.size[0] * header.size[1]
            if chunk and pixels + size > self.max_decode_pixels:
                self._resize_into(self._decode_chunk(images, chunk, refused), headers, out)
                chunk, pixels = [], 0
            chunk.append(i)
            pixels += size
        if chunk:
            self._resize_into(self._decode_chunk(images, chunk, refused), headers, out)
        return refused

    def _decode_chunk(
        self, images: Sequence[bytes], chunk: list[int], refused: list[int]
    ) -> list[tuple[int, torch.Tensor]]:
        # A copy per image: torch wants a writable buffer and nvJPEG reads it asynchronously.
        encoded = [torch.frombuffer(bytearray(images[i]), dtype=torch.uint8) for i in chunk]
        try:
            with _quiet_deprecation(), self._streams.decoding():
                decoded = self._decode_jpeg(encoded, mode=self._rgb, device=self.device)
            self._streams.hand_over(decoded)
        except RuntimeError as exc:  # a refused image, or out of memory: halve and retry
            if is_fatal_device_error(exc):
                raise ExecutorFatal(f"{self.device}: JPEG decode: {exc}") from exc
            if len(chunk) == 1:
                refused.append(chunk[0])
                return []
            mid = len(chunk) // 2
            first = self._decode_chunk(images, chunk[:mid], refused)
            return first + self._decode_chunk(images, chunk[mid:], refused)
        return list(zip(chunk, decoded, strict=True))

    def _resize_into(
        self,
        decoded: list[tuple[int, torch.Tensor]],
        headers: Sequence[Header | ClipserveError],
        out: torch.Tensor,
    ) -> None:
        """Orient, resize and crop each decoded image into its row of `out`, one interpolate
        call per group of images of the same size."""
        groups: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        for i, image in decoded:
            header = headers[i]
            assert isinstance(header, Header)
            upright = _orient(image, header.orientation)
            groups.setdefault((upright.shape[-2], upright.shape[-1]), []).append((i, upright))
        for (height, width), members in groups.items():
            new_w, new_h = resized_size(width, height, self.spec)
            left, top, right, bottom = center_box(new_w, new_h, self.spec)
            per_call = max(1, self.max_resize_pixels // (height * width))
            for start in range(0, len(members), per_call):
                part = members[start : start + per_call]
                batch = torch.stack([image for _, image in part])
                if (new_h, new_w) != (height, width):
                    batch = self._resize(batch, new_h, new_w)[..., top:bottom, left:right]
                else:
                    batch = batch[..., top:bottom, left:right]
                _write_rows(out, [i for i, _ in part], batch.permute(0, 2, 3, 1))

    def _resize(self, batch: torch.Tensor, new_h: int, new_w: int) -> torch.Tensor:
        """Pillow's resize: a horizontal pass, then a vertical one, each rounded to 8 bits (one
        float pass instead differs by up to 4 levels where bicubic overshoots)."""
        if self.uint8_resize:  # torch's CPU kernel for uint8 is Pillow's own, 5x faster
            return F.interpolate(
                batch, size=(new_h, new_w), mode=self._mode, align_corners=False, antialias=True
            )
        x = batch.float()
        for size in ((x.shape[-2], new_w), (new_h, new_w)):
            if size != tuple(x.shape[-2:]):
                x = F.interpolate(
                    x, size=size, mode=self._mode, align_corners=False, antialias=True
                )
                x = x.round_().clamp_(0, 255)
        return x.to(torch.uint8)


def _write_rows(out: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """`out[rows] = values` for ascending `rows`, one slice copy per run of consecutive rows:
    no index tensor to upload (a blocking host-to-device copy per group)."""
    start = 0
    for k in range(1, len(rows) + 1):
        if k == len(rows) or rows[k] != rows[k - 1] + 1:
            out[rows[start] : rows[k - 1] + 1].copy_(values[start:k])
            start = k


def crops_numpy(batch: DecodedBatch) -> np.ndarray:
    """The batch's crops as host uint8 NHWC (tests, benchmarks, and executors that take numpy)."""
    return np.ascontiguousarray(batch.pixels.cpu().numpy())


class EncodedAtAdmission:
    """`--decode gpu` at admission, in the decode pool: the host's checks only (header and
    entropy-coded data). A JPEG the device will decode passes through as its bytes behind the
    header's tag (a 1-D uint8 array: the batcher keeps such items together and the device worker
    decodes them as a batch, without parsing the header again); anything else (PNG, WebP, CMYK,
    a file over `max_bytes`) is decoded here as with `--decode cpu`."""

    def __init__(self, host: ImageDecoder, max_bytes: int | None = None) -> None:
        self.host = host
        self.max_bytes = max_bytes  # a front end's slot: longer files are decoded here
        self._checker = DeviceDecoder(host, CPU)

    def __call__(self, data: bytes) -> np.ndarray:
        header = self._checker.check(data)  # the CPU path's ClipserveError, if any
        size = len(data) + _TAGGED.size
        if header.on_device and (self.max_bytes is None or size <= self.max_bytes):
            return np.frombuffer(tagged(header, data), np.uint8)
        return self.host(data)
