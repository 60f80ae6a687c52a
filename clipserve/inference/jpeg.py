"""The fast JPEG path: simplejpeg's libjpeg-turbo decode with DCT scaling, then torch's uint8
antialiased resize, when both are usable; Pillow (preprocess.ImageDecoder) otherwise. Install
when simplejpeg imports (a dependency; where no wheel installs, every JPEG decodes through Pillow).

Decode is not all of Pillow's time: at 640x480 q90 its resize costs about as much. torch's uint8
kernel (AVX2) is Pillow's resample (the same weights and rounding: equal crops on scikit-image's
photos) and is cheap only when it writes channels-last: through F.interpolate its planar output
costs an unpack in the kernel and a transpose to HWC after, together more than the resize itself.
simplejpeg writes RGB straight into a numpy array. Numbers and parity: bench/jpeg_decoders.py,
bench/results/jpeg-decoders.json.

simplejpeg decodes strictly: libjpeg-turbo's corrupt-data warnings (truncated scans, bad
Huffman codes, restart markers out of order), which Pillow ignores, refuse the image. What
TurboJPEG cannot take but libjpeg may (its header parse gives up on odd sampling factors, or a
feature it lacks) goes to Pillow, which decodes it or refuses it as it always did.

The DCT scale is Pillow draft's (1/2, 1/4, 1/8: the caller asks for the drafted size). The finer
n/8 scales simplejpeg offers are no help: slower than the full decode (7/8, 6/8, 5/8 cost 2.3,
1.8, 1.4 times as much at 640x480; of the scales below 8/8 only 4/8 is cheaper), and
motorcycle_left drifts at every one (7/8: 3.3 levels; even an exact resize to 6/8 then to 224 is
7 levels off: its fine texture aliases).
Round 3 (bench/results/jpeg-decoders.json) kept libjpeg's plain chroma upsampling where the
resize then shrinks at least FAST_UPSAMPLE_SHRINK-fold (the doubled chroma pixels average out:
within 0.4 levels of open_clip); fancy upsampling elsewhere (an upscaled 200x150 drifts 0.55).
RGBX output, which torch's kernel reads without repacking, saved 3% in the kernel but cost more
served: the 4-byte-strided crop is slow for its consumers' copy.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from clipserve.errors import InvalidImage

log = logging.getLogger("clipserve.inference")

PILLOW = "pillow"
# torch's uint8 resample runs its vectorised kernel only with these; elsewhere (ARM, old x86) a
# float fallback that is slower than Pillow's.
_VECTOR_CAPABILITIES = ("AVX2", "AVX512")

# TurboJPEG's refusals that say "cannot", not "corrupt": its header parse knows fewer sampling
# layouts than libjpeg, and some processes (lossless, 12-bit) are not built in.
_UNSUPPORTED = ("Could not determine subsampling", "Unsupported", "not supported")
# Plain (replicating) chroma upsampling where the resize shrinks at least this much; None: never.
FAST_UPSAMPLE_SHRINK: float | None = 2.0

Box = tuple[int, int, int, int]  # left, top, right, bottom
# (bytes, (min width, min height), shrink) -> RGB uint8 HWC at the least DCT scale;
# `shrink` is how much the resize after it shrinks the image (the least of the two axes). None
# where the decoder cannot take the file (Pillow then decodes it); InvalidImage where the data
# is corrupt.
Decode = Callable[[bytes, tuple[int, int], float], np.ndarray | None]
# (RGB uint8 HWC, resized (width, height), crop box, "bicubic" | "bilinear") -> the crop, HWC.
ResizeCrop = Callable[[np.ndarray, tuple[int, int], Box, str], np.ndarray]


def refusal(error: Exception) -> InvalidImage | None:
    """What a libjpeg-turbo (simplejpeg) error says of a JPEG: None where TurboJPEG cannot take
    the file (odd sampling factors, a process it lacks), so another decoder (Pillow, nvJPEG)
    decides; the InvalidImage to raise where the data is corrupt. The CPU path and the GPU
    path's admission check both ask this, so the two agree on which files they refuse."""
    message = str(error)
    if any(words in message for words in _UNSUPPORTED):
        return None
    return InvalidImage(f"truncated or corrupt image data ({message})")


@dataclass(frozen=True)
class FastJpeg:
    """A DCT-scaling JPEG decoder and a uint8 resize-and-crop; `name` says which, for logs and
    /info."""

    name: str
    decode: Decode
    resize_crop: ResizeCrop


@functools.cache
def fast_jpeg() -> FastJpeg | None:
    """The fast path where simplejpeg and a vectorised torch are importable, else None; resolved
    once per process and logged, so the log says which decoder runs."""
    found = _load()
    if found is None:
        log.info("JPEG decode: Pillow (simplejpeg does not import here)")
    else:
        log.info("JPEG decode: %s", found.name)
    return found


def _load() -> FastJpeg | None:
    try:
        # Untyped (no stubs, no py.typed): imported by name, so mypy reads it the same whether
        # or not the extra is installed.
        simplejpeg = importlib.import_module("simplejpeg")
        import torch
    except ImportError:
        return None
    if torch.backends.cpu.get_cpu_capability() not in _VECTOR_CAPABILITIES:
        return None

    # Read once, here: benchmarks set it per server process before the first decode.
    shrink_for_fast = FAST_UPSAMPLE_SHRINK

    def decode(data: bytes, size: tuple[int, int], shrink: float) -> np.ndarray | None:
        fast_upsample = shrink_for_fast is not None and shrink >= shrink_for_fast
        try:
            array: np.ndarray = simplejpeg.decode_jpeg(
                data,
                colorspace="RGB",
                fastupsample=fast_upsample,
                min_width=size[0],
                min_height=size[1],
                strict=True,
            )
        except ValueError as e:
            refused = refusal(e)
            if refused is None:
                return None
            raise refused from None
        return array

    name = f"simplejpeg {simplejpeg.__version__} (DCT scaling) + torch {torch.__version__} resize"
    return FastJpeg(name, decode, _torch_resize_crop)


def _torch_resize_crop(
    array: np.ndarray, size: tuple[int, int], box: Box, interpolation: str
) -> np.ndarray:
    """Pillow's resample (antialiased, edge-clamped) by torch's uint8 kernel into a channels-last
    buffer, and the crop as a view of it: no copy after the kernel (the batch's stack is the one
    copy). The GIL is released while it runs."""
    import torch

    width, height = size
    if not array.flags.writeable:  # torch.from_numpy warns on read-only arrays
        array = array.copy()
    source = torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0)  # NCHW, channels-last
    out = torch.empty((1, height, width, 3), dtype=torch.uint8)
    # The `out` overload keeps the layout we give it; F.interpolate would return planar NCHW.
    _aa_kernel(interpolation)(
        source, [height, width], False, None, None, out=out.permute(0, 3, 1, 2)
    )
    left, top, right, bottom = box
    crop: np.ndarray = out.numpy()[0, top:bottom, left:right]
    return crop


@functools.cache
def _aa_kernel(interpolation: str) -> Any:
    """torch's antialiased resample, the overload that writes into a given tensor."""
    import torch

    aten = torch.ops.aten
    return {"bicubic": aten._upsample_bicubic2d_aa, "bilinear": aten._upsample_bilinear2d_aa}[
        interpolation
    ].out


# EXIF orientation -> the array steps of ImageOps.exif_transpose (PIL's rotations are
# counter-clockwise; np.rot90 with k=1 is too).
_ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),
    8: lambda a: np.rot90(a, 1),
}


def orient(array: np.ndarray, orientation: int) -> np.ndarray:
    """`array` upright as ImageOps.exif_transpose makes an image with this EXIF orientation."""
    step = _ORIENT.get(orientation)
    return array if step is None else np.ascontiguousarray(step(array))
