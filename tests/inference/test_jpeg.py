"""The fast JPEG path (simplejpeg + torch's resize): parity with open_clip's own preprocess and
with the Pillow path on real photos, the same errors and limits, and the Pillow fallback where
simplejpeg is not installed."""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image, ImageOps

from clipserve.backends.base import normalise_numpy
from clipserve.errors import ImageTooLarge, InvalidImage
from clipserve.inference.jpeg import FastJpeg, fast_jpeg, orient, refusal
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import encode, jpeg, synthetic_image
from tests.helpers import with_orientation
from tests.inference.corrupt_jpeg import sos_length_too_long

skimage_data = pytest.importorskip("skimage.data")

CFG = PreprocessCfg(size=224)
SPEC = PreprocessSpec.from_open_clip(
    {"size": 224, "mean": CFG.mean, "std": CFG.std, "interpolation": "bicubic"}
)
FAST = fast_jpeg()
# The dev extra installs simplejpeg; the fallback test at the end runs without it.
needs_fast = pytest.mark.skipif(FAST is None, reason="simplejpeg not installed")
# Stated parity, per 224x224 crop, of both paths against open_clip's own preprocess on
# scikit-image's photos below (round 3, bench/results/jpeg-decoders.json): worst mean 0.453
# levels, cosine 0.999815 (retina, at 1/2 scale; the Pillow path the same); the fast path's plain
# chroma upsampling (at shrinks >= 2) adds up to 0.4 levels (motorcycle_left 0.38, 0.99991).
# motorcycle_left at DRAFT_MARGIN 1 was 4.7 levels, cosine 0.990.
MEAN_LEVELS_FROM_OPEN_CLIP = 0.5
MIN_TENSOR_COSINE = 0.9998  # normalised tensors vs open_clip's
# The fast path against the Pillow path at the same DCT scale: torch's resample is Pillow's
# (the same kernel and rounding), so with fancy upsampling a level at most, and rarely; plain
# upsampling (where the resize shrinks >= 2x) moves chroma by a few levels in places.
MAX_LEVELS_FROM_PILLOW = 1
MEAN_LEVELS_FROM_PILLOW = 0.01
MAX_LEVELS_FROM_PILLOW_FAST_UPSAMPLE = 16  # worst: motorcycle_right 15
MEAN_LEVELS_FROM_PILLOW_FAST_UPSAMPLE = 0.45  # worst: motorcycle_left 0.38


def real_photos() -> list[tuple[str, bytes]]:
    """scikit-image's sample photographs as q90 JPEGs, at sizes that take each DCT scale."""
    folder = Path(skimage_data.__file__).parent
    out = []
    names = ("astronaut", "chelsea", "coffee", "motorcycle_left", "motorcycle_right", "camera")
    for name in names:
        img = Image.open(folder / f"{name}.png")
        out.append((f"{name}-{img.width}x{img.height}", encode(img, "JPEG")))
    rocket = Image.open(folder / "rocket.jpg")
    for w, h in [(640, 480), (1920, 1080), (4000, 3000), (200, 150)]:
        out.append((f"rocket-{w}x{h}", encode(rocket.resize((w, h), Image.Resampling.LANCZOS))))
    out.append(("retina.jpg", (folder / "retina.jpg").read_bytes()))  # 1411x1411 as shipped
    return out


PHOTOS = real_photos()


def open_clip_tensor(data: bytes) -> np.ndarray:
    """open_clip's own preprocess (after exif_transpose): the normalised CHW float tensor."""
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    return np.asarray(image_transform_v2(CFG, is_train=False)(img))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


def parity(crop: np.ndarray, data: bytes) -> tuple[float, float]:
    """(mean |level| difference, tensor cosine) of a crop against open_clip's preprocess."""
    ref = open_clip_tensor(data)
    std, mean = (np.asarray(v, np.float32)[:, None, None] for v in (CFG.std, CFG.mean))
    ref_levels = np.clip(np.round((ref * std + mean) * 255), 0, 255)
    levels = np.abs(crop.transpose(2, 0, 1).astype(np.float32) - ref_levels).mean()
    return float(levels), cosine(normalise_numpy(np.ascontiguousarray(crop)[None], SPEC)[0], ref)


@needs_fast
def test_the_fast_path_is_chosen_when_installed() -> None:
    assert FAST is not None and FAST.name.startswith("simplejpeg")
    assert ImageDecoder(SPEC, 10**8).jpeg_decoder == FAST.name
    assert ImageDecoder(SPEC, 10**8, jpeg=None).jpeg_decoder == "pillow"
    assert ImageDecoder(SPEC, 10**8, fast=False).jpeg_decoder == "pillow"  # exact: Pillow


@pytest.mark.parametrize(("name", "data"), PHOTOS, ids=[p[0] for p in PHOTOS])
def test_real_photos_match_open_clip_within_the_stated_parity(name: str, data: bytes) -> None:
    """Both JPEG paths (the fast one where installed, Pillow's, the fallback) against open_clip
    on real photos: synthetic images hid motorcycle_left's drift at DRAFT_MARGIN 1."""
    paths = [ImageDecoder(SPEC, 10**8, jpeg=None)] + ([ImageDecoder(SPEC, 10**8)] if FAST else [])
    for decoder in paths:
        levels, cos = parity(decoder(data), data)
        assert levels <= MEAN_LEVELS_FROM_OPEN_CLIP, (decoder.jpeg_decoder, levels)
        assert cos >= MIN_TENSOR_COSINE, (decoder.jpeg_decoder, cos)


def test_the_parity_test_catches_a_draft_margin_of_1() -> None:
    """At DRAFT_MARGIN 1, motorcycle_left decodes at 1/2 scale (371x250) and the crop comes out
    sharper than open_clip's: the test above would fail."""
    data = dict(PHOTOS)["motorcycle_left-741x500"]
    levels, cos = parity(ImageDecoder(SPEC, 10**8, jpeg=None, draft_margin=1)(data), data)
    assert levels > 4 * MEAN_LEVELS_FROM_OPEN_CLIP and cos < MIN_TENSOR_COSINE


@needs_fast
@pytest.mark.parametrize(("name", "data"), PHOTOS, ids=[p[0] for p in PHOTOS])
@pytest.mark.parametrize("margin", [1, 2])
def test_real_photos_match_the_pillow_path(name: str, data: bytes, margin: int) -> None:
    fast = ImageDecoder(SPEC, 10**8, draft_margin=margin)(data)
    pillow = ImageDecoder(SPEC, 10**8, jpeg=None, draft_margin=margin)(data)
    # HxWx3 uint8 with packed pixels; rows may be strided (a view of the resized image)
    assert fast.shape == (224, 224, 3) and fast.dtype == np.uint8 and fast.strides[1:] == (3, 1)
    diff = np.abs(fast.astype(np.int16) - pillow.astype(np.int16))
    drafted = Image.open(io.BytesIO(data))
    drafted.draft(None, (224 * margin, 224 * margin))
    if min(drafted.size) >= 2 * 224:  # plain chroma upsampling
        assert diff.max() <= MAX_LEVELS_FROM_PILLOW_FAST_UPSAMPLE
        assert diff.mean() <= MEAN_LEVELS_FROM_PILLOW_FAST_UPSAMPLE
    else:
        assert diff.max() <= MAX_LEVELS_FROM_PILLOW and diff.mean() <= MEAN_LEVELS_FROM_PILLOW


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_exif_transpose(orientation: int) -> None:
    img = synthetic_image(40, 24, seed=orientation)
    data = with_orientation(img, orientation)
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(orient(decoded, orientation), want)


@needs_fast
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_rotated_photos_match_the_pillow_path(orientation: int) -> None:
    data = with_orientation(synthetic_image(640, 400, seed=2), orientation)
    fast = ImageDecoder(SPEC, 10**8)(data).astype(np.int16)
    pillow = ImageDecoder(SPEC, 10**8, jpeg=None)(data).astype(np.int16)
    assert np.abs(fast - pillow).max() <= MAX_LEVELS_FROM_PILLOW


def _corrupt(data: bytes) -> bytes:
    """Entropy-coded data overwritten mid-file: libjpeg-turbo warns, Pillow decodes anyway."""
    mid = len(data) // 2
    return data[:mid] + b"\x00" * 200 + data[mid + 200 :]


JPEG = encode(synthetic_image(640, 480, seed=4), "JPEG")
BAD = [
    ("truncated", JPEG[:3000]),
    ("header-only", JPEG[:700]),
    ("no-end-marker", JPEG[:-2]),
    ("corrupt-middle", _corrupt(JPEG)),
]


@needs_fast
@pytest.mark.parametrize(("name", "data"), BAD, ids=[b[0] for b in BAD])
def test_the_fast_path_refuses_corrupt_data(name: str, data: bytes) -> None:
    """libjpeg-turbo's corrupt-data warnings refuse the image (Pillow decodes the last two:
    it silences them)."""
    with pytest.raises(InvalidImage, match="truncated or corrupt image data"):
        ImageDecoder(SPEC, 10**8)(data)


class CountingJpeg:
    """The real fast path, counting its decodes (to show limits act before any decode)."""

    def __init__(self, real: FastJpeg) -> None:
        self.calls = 0
        self.jpeg = FastJpeg("counting " + real.name, self._decode, real.resize_crop)
        self._real = real

    def _decode(self, data: bytes, size: tuple[int, int], shrink: float) -> np.ndarray | None:
        self.calls += 1
        return self._real.decode(data, size, shrink)


@needs_fast
def test_limits_refuse_before_the_fast_decoder_runs() -> None:
    assert FAST is not None
    big = encode(synthetic_image(3000, 2000, seed=1), "JPEG")
    counting = CountingJpeg(FAST)
    with pytest.raises(ImageTooLarge, match="--max-image-pixels"):
        ImageDecoder(SPEC, 5_000_000, jpeg=counting.jpeg)(big)
    with pytest.raises(ImageTooLarge, match="--max-decode-bytes"):
        ImageDecoder(SPEC, 10**8, max_bytes=100_000, jpeg=counting.jpeg)(big)
    with pytest.raises(InvalidImage, match="--max-image-aspect"):
        thin = encode(synthetic_image(2000, 20), "JPEG")
        ImageDecoder(SPEC, 10**8, max_aspect=50, jpeg=counting.jpeg)(thin)
    assert counting.calls == 0
    assert ImageDecoder(SPEC, 10**8, jpeg=counting.jpeg)(big).shape == (224, 224, 3)
    assert counting.calls == 1


@needs_fast
def test_cmyk_jpegs_go_to_pillow() -> None:
    """libjpeg-turbo cannot turn CMYK into RGB; Pillow's conversion is open_clip's."""
    assert FAST is not None
    counting = CountingJpeg(FAST)
    data = encode(synthetic_image(640, 480, seed=6).convert("CMYK"), "JPEG")
    out = ImageDecoder(SPEC, 10**8, jpeg=counting.jpeg)(data)
    np.testing.assert_array_equal(out, ImageDecoder(SPEC, 10**8, jpeg=None)(data))
    assert counting.calls == 0


@needs_fast
@pytest.mark.parametrize("data", [JPEG[:400] + bytes(range(256)) * 8, sos_length_too_long()])
def test_what_turbojpeg_cannot_parse_goes_to_pillow(data: bytes) -> None:
    """TurboJPEG's header parse gives up ("could not determine subsampling") where libjpeg may
    not: Pillow then decides, here with its own refusal."""
    assert FAST is not None
    counting = CountingJpeg(FAST)
    with pytest.raises(InvalidImage) as fast:
        ImageDecoder(SPEC, 10**8, jpeg=counting.jpeg)(data)
    with pytest.raises(InvalidImage) as pillow:
        ImageDecoder(SPEC, 10**8, jpeg=None)(data)
    assert counting.calls == 1 and str(fast.value) == str(pillow.value)


UNPARSEABLE = [
    ("garbage-after-header", JPEG[:400] + bytes(range(256)) * 8),
    ("sos-length-too-long", sos_length_too_long()),
]


@needs_fast
@pytest.mark.parametrize(("name", "data"), BAD + UNPARSEABLE, ids=[b[0] for b in BAD + UNPARSEABLE])
def test_refusal_tells_corrupt_data_from_what_turbojpeg_cannot_take(name: str, data: bytes) -> None:
    simplejpeg = importlib.import_module("simplejpeg")  # untyped: by name
    with pytest.raises(ValueError) as raised:
        simplejpeg.decode_jpeg(data, "RGB", strict=True)
    refused = refusal(raised.value)
    if name in dict(UNPARSEABLE):  # "Could not determine subsampling": Pillow decides
        assert refused is None
    else:
        assert isinstance(refused, InvalidImage)
        assert refused.message.startswith("truncated or corrupt image data (")


@needs_fast
def test_the_gpu_check_shares_the_cpu_paths_verdicts() -> None:
    """`DeviceDecoder.check` (run on the CPU here) refuses corrupt data with the CPU path's
    error, and passes what TurboJPEG cannot take to the host decoder instead of refusing it:
    both paths then answer with Pillow's verdict."""
    from clipserve.inference.gpu_decode import DeviceDecoder

    host = ImageDecoder(SPEC, 10**8)
    gpu = DeviceDecoder(host, "cpu")
    with pytest.raises(InvalidImage, match="truncated or corrupt image data"):
        gpu.check(dict(BAD)["corrupt-middle"])
    for _, data in UNPARSEABLE:
        assert not gpu.check(data).on_device  # not refused: the host decoder decides
        batch = gpu.decode([data])
        with pytest.raises(InvalidImage) as cpu:
            host(data)
        assert batch.ok == [] and batch.errors[0].message == cpu.value.message


@needs_fast
def test_a_pillow_cmyk_jpeg_is_not_unsupported_but_goes_to_pillow_by_mode() -> None:
    """simplejpeg decodes Pillow's (Adobe, inverted) CMYK JPEGs without complaint, so no error
    classifies them: both paths route them by mode. The CPU path never hands them to
    simplejpeg (its RGB conversion is not Pillow's); the GPU check scans them and sends them to
    the host decoder."""
    from clipserve.inference.gpu_decode import DeviceDecoder

    simplejpeg = importlib.import_module("simplejpeg")  # untyped: by name

    data = encode(synthetic_image(320, 240, seed=6).convert("CMYK"), "JPEG")
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    assert simplejpeg.decode_jpeg(data, "CMYK", strict=True).shape == (240, 320, 4)
    header = DeviceDecoder(ImageDecoder(SPEC, 10**8), "cpu").check(data)
    assert not header.on_device and header.size == (320, 240)


FALLBACK = """
import sys
sys.modules["simplejpeg"] = None  # as if simplejpeg had no wheel here
import numpy as np
from clipserve.inference.jpeg import fast_jpeg
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import jpeg
spec = PreprocessSpec((224, 224), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
decoder = ImageDecoder(spec, 10**8)
out = decoder(jpeg(640, 480, seed=3))
print(fast_jpeg() is None, decoder.jpeg_decoder, out.shape, int(out.sum()))
"""


def test_without_simplejpeg_pillow_decodes() -> None:
    """A host where simplejpeg is absent: the same decoder object, Pillow underneath,
    the same pixels as the Pillow path here."""
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK], capture_output=True, text=True, check=True, timeout=120
    )
    spec = PreprocessSpec((224, 224), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    want = ImageDecoder(spec, 10**8, jpeg=None)(jpeg(640, 480, seed=3))
    assert done.stdout.split() == ["True", "pillow", "(224,", "224,", "3)", str(int(want.sum()))]
