"""What `--decode gpu` must get right before nvJPEG ever runs (inference/gpu_decode.py and
inference/nvjpeg.py): corrupt JPEGs refused with a 400, decoded chunks kept from reuse until
their readers are done, one nvJPEG device per process, admission's header carried along."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from clipserve.errors import ClipserveError, InvalidImage, StartupError
from clipserve.inference.gpu_decode import (
    DeviceDecoder,
    EncodedAtAdmission,
    Header,
    crops_numpy,
    tagged,
    untagged,
)
from clipserve.inference.nvjpeg import NvjpegOwner, indexed
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import jpeg
from tests.helpers import Serve
from tests.inference.corrupt_jpeg import CORPUS, photo

SPEC = PreprocessSpec((224, 224), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
JPEG = {"Content-Type": "image/jpeg"}
# Pillow silences libjpeg's corrupt-data warnings and returns an image for these; the CPU path
# refuses them through its fast JPEG decoder (inference/jpeg.py: simplejpeg, strict), which
# the GPU path needs anyway. Without simplejpeg the CPU path is Pillow's and serves them.
PILLOW_ACCEPTS = {"truncated_scan", "bad_huffman_code", "zeroed_scan", "restart_out_of_order"}
# TurboJPEG cannot read these headers ("could not determine subsampling"): jpeg.refusal calls
# that unsupported, not corrupt, so the scan check lets them pass, but off the device: the host
# decoder (Pillow) refuses them, as on the CPU path.
HOST_REFUSES = {"sos_length_too_long"}


def host() -> ImageDecoder:
    return ImageDecoder(SPEC, 40_000_000)


def decoder(**kw: Any) -> DeviceDecoder:
    return DeviceDecoder(host(), "cpu", **kw)


# ---------------------------------------------------------------------------------------------
# The corrupt corpus


def test_the_photo_itself_passes_every_check() -> None:
    dec = decoder()
    for data in (photo(), photo(restart_rows=4)):
        assert dec.check(data) == Header(True, (512, 512))
        assert dec.decode([data]).ok == [0]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_gpu_paths_checks_refuse_each_corrupt_jpeg(name: str) -> None:
    data = CORPUS[name]()
    dec = decoder()
    if name in HOST_REFUSES:
        assert not dec.check(data).on_device
    else:
        with pytest.raises(InvalidImage) as refused:
            dec.check(data)
        assert refused.value.code == "invalid_image"
    with pytest.raises(InvalidImage):
        EncodedAtAdmission(host())(data)  # admission: never passed on to the device
    batch = dec.decode([photo(), data, photo()])  # bytes that skipped admission: same answer
    assert batch.ok == [0, 2] and isinstance(batch.errors[1], InvalidImage)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_cpu_path_refuses_each_corrupt_jpeg(name: str) -> None:
    assert host().jpeg_decoder.startswith("simplejpeg")  # the dev extra: the CPU path's decoder
    with pytest.raises(InvalidImage) as refused:
        host()(CORPUS[name]())
    assert refused.value.code == "invalid_image"


@pytest.mark.parametrize("name", sorted(PILLOW_ACCEPTS))
def test_pillow_alone_serves_the_data_corruptions(name: str) -> None:
    """What the fast decoder adds: Pillow (the fallback) decodes these into a crop."""
    assert ImageDecoder(SPEC, 40_000_000, jpeg=None)(CORPUS[name]()).shape == (224, 224, 3)


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_served_each_corrupt_jpeg_gets_a_400(serve: Serve, decode: str) -> None:
    server = serve(backend="fake", decode=decode)
    good = httpx.post(server.url + "/embed", content=photo(), headers=JPEG)
    assert good.status_code == 200 and len(good.json()["embedding"]) > 0
    for name, make in CORPUS.items():
        r = httpx.post(server.url + "/embed", content=make(), headers=JPEG)
        assert r.status_code == 400, (name, r.text)
        assert set(r.json()) == {"error"} and r.json()["error"]["code"] == "invalid_image"


# ---------------------------------------------------------------------------------------------
# Chunks kept from reuse until their readers are done


class WatchedDecode:
    """torchvision's decode, watched: at each call, every output of an earlier call of this
    batch must still be alive (on CUDA, record_stream is what keeps its memory from the next
    call's outputs; on the host, the decoder's reference)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.outputs: list[weakref.ref[torch.Tensor]] = []
        self.calls = 0
        self.released_early: list[int] = []

    def __call__(self, encoded: Sequence[torch.Tensor], **kw: Any) -> list[torch.Tensor]:
        gc.collect()
        self.released_early += [k for k, ref in enumerate(self.outputs) if ref() is None]
        self.calls += 1
        decoded: list[torch.Tensor] = self.real(list(encoded), **kw)
        self.outputs += [weakref.ref(t) for t in decoded]
        return decoded


def test_no_chunk_is_released_before_the_batch_is_done() -> None:
    dec = decoder(max_decode_pixels=2 * 640 * 480)  # two images per chunk
    watched = WatchedDecode(dec._decode_jpeg)
    dec._decode_jpeg = watched
    images = [jpeg(640, 480, seed=i) for i in range(7)]
    batch = dec.decode(images)
    assert batch.ok == list(range(7)) and watched.calls == 4
    assert watched.released_early == []
    gc.collect()
    assert all(ref() is None for ref in watched.outputs)  # and then let go: nothing leaks
    alone = np.stack([crops_numpy(decoder().decode([data]))[0] for data in images])
    assert np.array_equal(crops_numpy(batch), alone)


def test_rows_land_in_input_order_around_failures_without_index_tensors() -> None:
    sizes = [(640, 480), (320, 240), (640, 480), (320, 240), (640, 480)]
    images = [jpeg(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    images.insert(2, b"junk")
    batch = decoder().decode(images)  # two size groups, interleaved, one failure between
    assert batch.ok == [0, 1, 3, 4, 5]
    want = np.stack([crops_numpy(decoder().decode([images[i]]))[0] for i in batch.ok])
    assert np.array_equal(crops_numpy(batch), want)


# ---------------------------------------------------------------------------------------------
# One nvJPEG device per process


def test_one_cuda_device_per_process_owns_nvjpeg() -> None:
    owner = NvjpegOwner()
    first = DeviceDecoder(host(), "cuda", owner=owner)  # no CUDA call until decode
    assert first.device == torch.device("cuda:0") == owner.device  # indexed, as torchvision needs
    DeviceDecoder(host(), "cuda:0", owner=owner)  # the same device again: fine
    DeviceDecoder(host(), "cpu", owner=owner)  # the host decoder has no process-wide state
    with pytest.raises(StartupError, match="cuda:1 cannot decode in this process, cuda:0 does"):
        DeviceDecoder(host(), "cuda:1", owner=owner)
    assert indexed("cpu") == torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Admission's header travels with the bytes


def test_admission_tags_the_bytes_and_the_device_thread_trusts_the_tag() -> None:
    data = jpeg(640, 480, seed=1)
    item = EncodedAtAdmission(host())(data)
    assert item.ndim == 1 and item.dtype == np.uint8
    header, body = untagged(item.tobytes())
    assert header == Header(True, (640, 480)) and body == data
    assert untagged(data) == (None, data)  # raw bytes: checked on the device thread instead

    dec = decoder()
    calls: list[bytes] = []
    real = dec.checked

    def counted(data: bytes) -> Header | ClipserveError:
        calls.append(data)
        return real(data)

    dec.checked = counted  # type: ignore[method-assign]
    batch = dec.decode([item.tobytes(), data])
    assert batch.ok == [0, 1] and calls == [data]  # only the untagged one is parsed again
    rows = crops_numpy(batch)
    assert np.array_equal(rows[0], rows[1])
    # The tag is what is trusted: a header saying "host" sends a JPEG to the host decoder.
    routed = dec.decode([tagged(Header(False, (640, 480)), data)])
    assert (routed.on_device, routed.on_host) == (0, 1)


def test_admission_decodes_what_would_not_fit_a_slot_with_its_tag() -> None:
    data = jpeg(320, 240, seed=2)
    fits = EncodedAtAdmission(host(), max_bytes=len(data) + 14)(data)
    assert fits.ndim == 1
    too_long = EncodedAtAdmission(host(), max_bytes=len(data) + 13)(data)
    assert too_long.shape == (224, 224, 3)
