"""`GET /info` names the JPEG decoder that runs (inference/jpeg.py's fast path, or Pillow)."""

from __future__ import annotations

import httpx

from clipserve.inference.jpeg import fast_jpeg
from tests.helpers import Serve


def test_info_names_the_jpeg_decoder(serve: Serve) -> None:
    fast = fast_jpeg()
    host = "pillow" if fast is None else fast.name
    cpu = httpx.get(serve(backend="fake").url + "/info").json()
    assert cpu["jpeg_decoder"] == host
    gpu = httpx.get(serve(backend="fake", decode="gpu").url + "/info").json()
    assert (
        gpu["jpeg_decoder"]
        == f"torchvision decode_jpeg on the device (nvJPEG on CUDA); host: {host}"
    )
