"""--jpeg-scaling: parity (the default: DCT-scaled only to twice the model's input) or fast (to
the input size, as Pillow's draft did). The decoder each setting builds, its stated parity with
open_clip on real photos, and that both server layouts (one process, and --workers 2's front
ends) decode with the setting they were given."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from clipserve.config import LimitsConfig, load_config
from clipserve.errors import ConfigError
from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from tests.helpers import Serve, cli_server
from tests.inference.test_jpeg import PHOTOS, SPEC, parity

skimage_data = pytest.importorskip("skimage.data")

# Stated for fast (README's option table, --help): scikit-image's photos within 4.7 mean levels
# of open_clip's crop and a tensor cosine of 0.990 (motorcycle_left, the worst: 4.66, 0.9901).
FAST_MEAN_LEVELS = 4.7
FAST_MIN_COSINE = 0.990


def motorcycle() -> bytes:
    """motorcycle_left (741x500): fast decodes it at 1/2 scale, parity in full."""
    out = io.BytesIO()
    Image.open(Path(skimage_data.__file__).parent / "motorcycle_left.png").convert("RGB").save(
        out, "JPEG", quality=90
    )
    return out.getvalue()


def test_each_setting_builds_its_decoder() -> None:
    data = motorcycle()
    fast = ImageDecoder.from_limits(SPEC, LimitsConfig(), "fast")
    parity_decoder = ImageDecoder.from_limits(SPEC, LimitsConfig())
    assert (fast.jpeg_scaling, parity_decoder.jpeg_scaling) == ("fast", "parity")
    assert np.array_equal(fast(data), ImageDecoder(SPEC, 10**8, draft_margin=1)(data))
    assert np.array_equal(parity_decoder(data), ImageDecoder(SPEC, 10**8)(data))
    assert not np.array_equal(fast(data), parity_decoder(data))


def test_other_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="--jpeg-scaling"):
        load_config({"jpeg_scaling": "exact"}, environ={})
    with pytest.raises(ValueError, match="jpeg_scaling"):  # not silently parity
        ImageDecoder.from_limits(SPEC, LimitsConfig(), "Fast")


@pytest.mark.parametrize(("name", "data"), PHOTOS, ids=[p[0] for p in PHOTOS])
def test_fast_keeps_its_stated_parity(name: str, data: bytes) -> None:
    levels, cos = parity(ImageDecoder.from_limits(SPEC, LimitsConfig(), "fast")(data), data)
    assert levels <= FAST_MEAN_LEVELS and cos >= FAST_MIN_COSINE, (levels, cos)


def _embed(url: str, body: bytes, headers: dict[str, str]) -> np.ndarray:
    r = httpx.post(url + "/embed", content=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    one = answer["embedding"] if "embedding" in answer else answer["embeddings"][0]
    return np.asarray(one, np.float32)


def _served_crop_is(url: str, spec: PreprocessSpec, margin: int, tries: int = 1) -> None:
    """The server's embedding of the JPEG is its embedding of the crop this margin decodes, and
    not of the other margin's; `tries` times, each on a new connection (with --workers N, the
    kernel hands each to one of the front ends)."""
    data = motorcycle()
    tensor = {"content-type": "application/octet-stream", "x-tensor-dtype": "uint8"}
    crops = {m: ImageDecoder(spec, 10**8, draft_margin=m)(data) for m in (1, 2)}
    shape = {"x-tensor-shape": "1," + ",".join(map(str, crops[1].shape))}
    of_crop = {
        m: _embed(url, np.ascontiguousarray(c).tobytes(), {**tensor, **shape})
        for m, c in crops.items()
    }
    for _ in range(tries):
        served = _embed(url, data, {"content-type": "image/jpeg"})
        # The same crop through the same model: equal but for float rounding across batches;
        # the other margin's crop moves the tiny model's embedding by a few thousandths.
        assert np.abs(served - of_crop[margin]).max() < 1e-4
        assert np.abs(served - of_crop[3 - margin]).max() > 1e-3
        info = httpx.get(url + "/info").json()
        assert info["jpeg_scaling"] == ("fast" if margin == 1 else "parity")


def test_one_process_decodes_with_the_setting(serve: Serve) -> None:
    for scaling, margin in (("fast", 1), ("parity", 2)):
        server = serve(jpeg_scaling=scaling)
        _served_crop_is(server.url, server.state.runtime.model.preprocess, margin)


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_front_ends_decode_with_the_setting(
    tiny_config: Path, tiny_checkpoint: Path, serve: Serve, tmp_path: Path
) -> None:
    """--workers 2: the front ends build their decoder from the config they were started with."""
    spec = serve().state.runtime.model.preprocess
    args = [
        "--workers",
        "2",
        "--model",
        str(tiny_config),
        "--checkpoint",
        str(tiny_checkpoint),
        "--backend",
        "torch",
        "--gpus",
        "cpu",
        "--threads",
        "1",
        "--cache-mb",
        "0",
        "--jpeg-scaling",
        "fast",
    ]
    with cli_server(args, tmp_path / "server.log") as (_, url):
        _served_crop_is(url, spec, margin=1, tries=8)  # both front ends, all but surely
