"""The device decoder (inference/gpu_decode.py): open_clip's pixels and embeddings, EXIF turns,
per-image fallback and errors, staging buffers. Runs on the CPU through torchvision's own
decoder; the `gpu` tests repeat the pixel checks with nvJPEG where a CUDA device is present."""

from __future__ import annotations

import concurrent.futures
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from clipserve.backends.base import normalise_numpy
from clipserve.errors import ExecutorFatal, ImageTooLarge, InvalidImage
from clipserve.inference.gpu_decode import DeviceDecoder, Header, crops_numpy
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import encode, jpeg, synthetic_image
from tests.helpers import corrupt_huffman, needs_cuda, with_orientation

# Measured on the CPU (torchvision's libjpeg-turbo) against open_clip's Pillow transform: max 2
# levels, mean <= 0.01 (Pillow's fixed-point filter weights); embedding 1 - cosine <= 1.2e-7 on
# the tiny model and on ViT-B-32 with random weights (the host fast path: 3e-6 and 1e-5).
MAX_PIXEL_DIFF = 2
MEAN_PIXEL_DIFF = 0.05
MIN_COSINE = 0.99999
# nvJPEG upsamples chroma differently from libjpeg-turbo (its luma matches: the grayscale image
# is exact). Measured on an H200 (torchvision 0.26, CUDA 13; bench/results/gpu-check-*), full
# decodes against Pillow differ by up to 83 levels at these synthetic images' colour edges, and
# 224x224 crops by max 75, mean <= 1.38 for images at least the crop's size; the 100x80 image,
# upscaled 2.8x, by mean 2.52. Embeddings stay within NVJPEG_MIN_COSINE.
NVJPEG_MEAN_PIXEL_DIFF = 1.5
NVJPEG_UPSCALED_MEAN_PIXEL_DIFF = 3.0  # images smaller than the crop magnify the difference
NVJPEG_MAX_PIXEL_DIFF = 96
NVJPEG_MIN_COSINE = 0.999
SIZES = [(640, 480), (1920, 1080), (480, 640), (300, 500), (256, 256), (224, 224), (100, 80)]


def open_clip_pixels(preprocess: Any, data: bytes) -> np.ndarray:
    """open_clip's eval transform up to ToTensor/Normalize, as uint8 HWC."""
    img = Image.open(io.BytesIO(data))
    for step in preprocess.transforms[:-2]:
        img = step(img)
    return np.asarray(img)


@pytest.fixture(scope="module")
def preprocess() -> Any:
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(size=224), is_train=False)


@pytest.fixture(scope="module")
def spec() -> PreprocessSpec:
    return PreprocessSpec.from_open_clip(
        {
            "size": 224,
            **open_clip.get_model_preprocess_cfg(
                open_clip.create_model("ViT-B-32", pretrained=None)
            ),
        }
    )


def decoder(spec: PreprocessSpec, device: str = "cpu", **kw: Any) -> DeviceDecoder:
    return DeviceDecoder(ImageDecoder(spec, 40_000_000), device, **kw)


def check_pixels(
    got: np.ndarray, want: np.ndarray, device: str = "cpu", upscaled: bool = False
) -> None:
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert got.shape == want.shape == (224, 224, 3)
    cpu = device == "cpu"
    most = MAX_PIXEL_DIFF if cpu else NVJPEG_MAX_PIXEL_DIFF
    mean = NVJPEG_UPSCALED_MEAN_PIXEL_DIFF if upscaled else NVJPEG_MEAN_PIXEL_DIFF
    mean = MEAN_PIXEL_DIFF if cpu else mean
    assert diff.max() <= most and diff.mean() <= mean, (diff.max(), diff.mean())


# ---------------------------------------------------------------------------------------------
# Pixels


def run_pixel_parity(
    device: str, spec: PreprocessSpec, preprocess: Any, uint8_resize: bool | None = None
) -> None:
    images = [jpeg(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    images.append(encode(synthetic_image(333, 222, 5).convert("L"), "JPEG"))  # grayscale
    images.append(encode(synthetic_image(640, 480, 6), "JPEG", progressive=True))
    images.append(jpeg(640, 480, seed=0))  # a second of one size: grouped into one resize
    dec = decoder(spec, device)
    if uint8_resize is not None:
        dec.uint8_resize = uint8_resize
    batch = dec.decode(images)
    assert batch.ok == list(range(len(images))) and not batch.errors
    assert (batch.on_device, batch.on_host) == (len(images), 0)
    assert batch.pixels.device.type == torch.device(device).type
    crops = crops_numpy(batch)
    for data, got in zip(images, crops, strict=True):
        upscaled = min(Image.open(io.BytesIO(data)).size) < 224
        check_pixels(got, open_clip_pixels(preprocess, data), device, upscaled)


@pytest.mark.parametrize("uint8_resize", [True, False], ids=["uint8-resize", "float-resize"])
def test_pixels_match_open_clips_transform(
    spec: PreprocessSpec, preprocess: Any, uint8_resize: bool
) -> None:
    """Both resize paths: uint8 (the CPU's) and the float one CUDA runs."""
    run_pixel_parity("cpu", spec, preprocess, uint8_resize)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_turns_like_pillow(spec: PreprocessSpec, orientation: int) -> None:
    data = with_orientation(jpeg(400, 240, seed=3), orientation, quality=95)
    dec = decoder(spec)
    header = dec.check(data)
    assert header.on_device and header.orientation == orientation
    batch = dec.decode([data])
    assert batch.on_device == 1
    exact = ImageDecoder(spec, 40_000_000, fast=False)(data)  # exif_transpose, then open_clip
    check_pixels(crops_numpy(batch)[0], exact)


def test_bilinear_and_squash_specs_follow_the_spec() -> None:
    spec = PreprocessSpec((224, 224), (0.5,) * 3, (0.5,) * 3, "bilinear", "squash")
    data = jpeg(640, 480, seed=2)
    got = crops_numpy(decoder(spec).decode([data]))[0]
    check_pixels(got, ImageDecoder(spec, 40_000_000, fast=False)(data))


# ---------------------------------------------------------------------------------------------
# Routing, fallback and errors: one image never fails its batch


def test_formats_nvjpeg_should_not_take_go_to_the_host(spec: PreprocessSpec) -> None:
    dec = decoder(spec)
    img = synthetic_image(320, 240, 1)
    png, webp = encode(img, "PNG"), encode(img, "WEBP")
    cmyk = encode(img.convert("CMYK"), "JPEG")
    trailing = jpeg(320, 240, seed=1) + b"camera trailer"
    for data in (png, webp, cmyk, trailing):
        assert not dec.check(data).on_device
    assert dec.check(jpeg(320, 240, seed=1) + b"\x00" * 8).on_device  # zero padding is fine
    images = [png, jpeg(320, 240, seed=1), cmyk, webp, trailing]
    batch = dec.decode(images)
    assert batch.ok == [0, 1, 2, 3, 4] and (batch.on_device, batch.on_host) == (1, 4)
    host = ImageDecoder(spec, 40_000_000)
    crops = crops_numpy(batch)
    for row in (0, 2, 3, 4):  # the host decoder's pixels, exactly
        assert np.array_equal(crops[row], host(images[row]))


def test_bad_images_fail_alone_with_the_cpu_paths_errors(spec: PreprocessSpec) -> None:
    dec = decoder(spec, max_decode_pixels=4 * 640 * 480)  # several chunks
    good = [jpeg(640, 480, seed=i) for i in range(6)]
    truncated = good[0][: len(good[0]) // 2]
    huge = encode(Image.new("RGB", (8000, 6000)), "JPEG")  # 48 Mpx > 40 Mpx limit
    thin = jpeg(4000, 10, seed=1)  # aspect 400:1 > 200:1
    images = [
        good[0],
        corrupt_huffman(good[1]),
        good[2],
        truncated,
        good[3],
        b"",
        huge,
        thin,
        good[4],
        b"not an image",
        good[5],
    ]
    batch = dec.decode(images)
    assert batch.ok == [0, 2, 4, 8, 10]
    kinds = {i: type(e) for i, e in batch.errors.items()}
    assert kinds == {
        1: InvalidImage,
        3: InvalidImage,
        5: InvalidImage,
        6: ImageTooLarge,
        7: InvalidImage,
        9: InvalidImage,
    }
    assert "aspect ratio" in batch.errors[7].message and "pixels" in batch.errors[6].message
    assert (batch.on_device, batch.on_host) == (5, 0)
    alone = crops_numpy(dec.decode([good[i] for i in range(6) if i != 1]))
    assert np.array_equal(crops_numpy(batch), alone)  # rows compacted in input order


class RefusingDecoder:
    """torchvision's decoder, refusing (as nvJPEG may) any list holding a marked image."""

    def __init__(self, real: Any, marker: bytes) -> None:
        self.real, self.marker, self.calls = real, marker, 0

    def __call__(self, encoded: Sequence[torch.Tensor], **kw: Any) -> Any:
        self.calls += 1
        if any(self.marker in bytes(t.numpy()) for t in encoded):
            raise RuntimeError("Error while decoding JPEG images: Failed to decode batch: 6")
        return self.real(list(encoded), **kw)


def test_images_the_device_refuses_are_found_by_halving_and_decoded_on_the_host(
    spec: PreprocessSpec,
) -> None:
    dec = decoder(spec)
    fake = RefusingDecoder(dec._decode_jpeg, b"REFUSE-ME")
    dec._decode_jpeg = fake
    refused = encode(synthetic_image(640, 480, 9), "JPEG", comment=b"REFUSE-ME")
    images = [jpeg(640, 480, seed=i) for i in range(15)]
    images[11] = refused
    images[4] = corrupt_huffman(images[4])  # refused too, and the host refuses it as well
    batch = dec.decode(images)
    assert batch.ok == [i for i in range(15) if i != 4]
    assert isinstance(batch.errors[4], InvalidImage)
    assert (batch.on_device, batch.on_host) == (13, 1)
    assert fake.calls <= 2 * 2 * 4 + 1  # two culprits: O(log n) calls each, not n
    host = ImageDecoder(spec, 40_000_000)
    assert np.array_equal(crops_numpy(batch)[batch.ok.index(11)], host(refused))


def test_a_fatal_device_error_stops_the_worker_instead_of_falling_back(
    spec: PreprocessSpec,
) -> None:
    dec = decoder(spec)

    def lost(encoded: Sequence[torch.Tensor], **kw: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dec._decode_jpeg = lost
    with pytest.raises(ExecutorFatal, match="illegal memory access"):
        dec.decode([jpeg(320, 240, seed=1), jpeg(320, 240, seed=2)])


def test_headers_checked_at_admission_are_used_as_given(spec: PreprocessSpec) -> None:
    dec = decoder(spec)
    images = [jpeg(320, 240, seed=1), b"junk", jpeg(320, 240, seed=2)]
    headers = [dec.checked(data) for data in images]
    assert isinstance(headers[0], Header) and isinstance(headers[1], InvalidImage)
    batch = dec.decode(images, headers=headers)
    assert batch.ok == [0, 2] and batch.errors == {1: headers[1]}
    with pytest.raises(ValueError, match="2 headers for 3 images"):
        dec.decode(images, headers=headers[:2])


def test_staging_buffer_is_filled_in_place_and_checked(spec: PreprocessSpec) -> None:
    dec = decoder(spec)
    out = torch.full((8, 224, 224, 3), 7, dtype=torch.uint8)
    images = [b"junk", jpeg(320, 240, seed=1), encode(synthetic_image(320, 240, 2), "PNG")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        batch = dec.decode(images, out=out, pool=pool)
    assert batch.ok == [1, 2] and batch.pixels.data_ptr() == out.data_ptr()
    host = ImageDecoder(spec, 40_000_000)
    assert np.array_equal(out[0].numpy(), crops_numpy(dec.decode([images[1]]))[0])
    assert np.array_equal(out[1].numpy(), host(images[2]))
    with pytest.raises(ValueError, match="cannot hold 3 crops"):
        dec.decode(images, out=out[:2])
    with pytest.raises(ValueError, match="cannot hold"):
        dec.decode(images, out=torch.empty((8, 224, 224, 3), dtype=torch.float32))


def test_an_all_bad_batch_has_no_rows(spec: PreprocessSpec) -> None:
    batch = decoder(spec).decode([b"", b"junk"])
    assert batch.ok == [] and tuple(batch.pixels.shape) == (0, 224, 224, 3)
    assert set(batch.errors) == {0, 1}


# ---------------------------------------------------------------------------------------------
# Embeddings: the decoder's pixels against open_clip's own preprocess


def parity_images() -> list[bytes]:
    images = [jpeg(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES)]
    images.append(with_orientation(jpeg(640, 480, seed=20), 6, quality=95))
    images.append(encode(synthetic_image(500, 375, 21).convert("L"), "JPEG"))
    return images


def min_cosine(model: Any, preprocess: Any, spec: PreprocessSpec, device: str = "cpu") -> float:
    from PIL import ImageOps

    images = parity_images()
    crops = crops_numpy(decoder(spec, device).decode(images))
    ref = torch.stack(
        [preprocess(ImageOps.exif_transpose(Image.open(io.BytesIO(d)))) for d in images]
    )
    with torch.inference_mode():
        ours = model.encode_image(torch.from_numpy(normalise_numpy(crops, spec)), normalize=True)
        theirs = model.encode_image(ref, normalize=True)
    return float((ours * theirs).sum(-1).min())


def test_embeddings_match_open_clip_tiny_model(tiny_config: Path) -> None:
    open_clip.add_model_config(tiny_config)
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(tiny_config.stem)
    spec = PreprocessSpec.from_open_clip(open_clip.get_model_preprocess_cfg(model))
    assert min_cosine(model.eval(), preprocess, spec) >= MIN_COSINE


@pytest.mark.slow
def test_embeddings_match_open_clip_vit_b32() -> None:
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32", pretrained=None)
    spec = PreprocessSpec.from_open_clip(open_clip.get_model_preprocess_cfg(model))
    assert min_cosine(model.eval(), preprocess, spec) >= MIN_COSINE


# ---------------------------------------------------------------------------------------------
# On a GPU: nvJPEG


@pytest.mark.gpu
@needs_cuda
def test_nvjpeg_pixels_match_open_clips_transform(spec: PreprocessSpec, preprocess: Any) -> None:
    run_pixel_parity("cuda:0", spec, preprocess)


@pytest.mark.gpu
@needs_cuda
def test_nvjpeg_fallback_and_errors(spec: PreprocessSpec) -> None:
    dec = decoder(spec, "cuda:0")
    good = jpeg(640, 480, seed=1)
    cmyk = encode(synthetic_image(320, 240, 1).convert("CMYK"), "JPEG")
    images = [good, corrupt_huffman(good), cmyk, with_orientation(good, 8, quality=95)]
    batch = dec.decode(images)
    assert batch.ok == [0, 2, 3] and isinstance(batch.errors[1], InvalidImage)
    assert batch.pixels.is_cuda and batch.on_host == 1
    exact = ImageDecoder(spec, 40_000_000, fast=False)
    crops = crops_numpy(batch)
    check_pixels(crops[0], exact(good), "cuda")
    check_pixels(crops[2], exact(images[3]), "cuda")


@pytest.mark.gpu
@needs_cuda
def test_nvjpeg_embeddings_match_open_clip_tiny_model(tiny_config: Path) -> None:
    open_clip.add_model_config(tiny_config)
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(tiny_config.stem)
    spec = PreprocessSpec.from_open_clip(open_clip.get_model_preprocess_cfg(model))
    assert min_cosine(model.eval(), preprocess, spec, "cuda:0") >= NVJPEG_MIN_COSINE
