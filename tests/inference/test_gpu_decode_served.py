"""`--decode gpu` served end to end: admission checks headers, the device worker decodes JPEGs
in batches. On this CPU the worker's decoder runs torchvision's CPU decode (nvJPEG's code path)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.helpers import (
    PNG,
    Serve,
    cli_server,
    corrupt_huffman,
    png_bytes,
    random_pixels,
    until_async,
)

JPEG = {"Content-Type": "image/jpeg"}


def jpeg(seed: int, size: tuple[int, int] = (320, 240)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1] // 8, size[0] // 8, 3))
    image = Image.fromarray(pixels.astype(np.uint8)).resize(size, Image.BICUBIC)  # smooth
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue()


def test_device_decoding_serves_the_cpu_paths_embeddings(serve: Serve) -> None:
    on_device = serve(backend="fake", decode="gpu")
    on_cpu = serve(backend="fake")
    for body in (jpeg(1), jpeg(2, (224, 224))):
        got = httpx.post(on_device.url + "/embed", content=body, headers=JPEG).json()
        want = httpx.post(on_cpu.url + "/embed", content=body, headers=JPEG).json()
        cosine = float(np.dot(got["embedding"], want["embedding"]))
        assert cosine > 0.999, cosine
    # A PNG is decoded at admission, as before: it never reaches the device decoder.
    png = png_bytes(random_pixels(4))
    got = httpx.post(on_device.url + "/embed", content=png, headers=PNG)
    want = httpx.post(on_cpu.url + "/embed", content=png, headers=PNG)
    assert got.json()["embedding"] == want.json()["embedding"]


def test_an_image_the_device_cannot_decode_fails_alone(serve: Serve) -> None:
    server = serve(
        backend="fake", decode="gpu", backend_option=["latency_ms=200"], max_queue_delay_ms=100
    )
    fake = server.state.runtime.executors[0]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = asyncio.create_task(client.post("/embed", content=jpeg(0), headers=JPEG))
            await until_async(lambda: fake.attempts)  # computing; the next three share one batch
            bodies = [jpeg(1), corrupt_huffman(jpeg(2)), jpeg(3)]
            rest = [client.post("/embed", content=b, headers=JPEG) for b in bodies]
            listed = client.post(
                "/embed", files=[("image", jpeg(5)), ("image", corrupt_huffman(jpeg(6)))]
            )
            return list(await asyncio.gather(first, *rest, listed))

    first, good1, bad, good2, listed = asyncio.run(main())
    assert [r.status_code for r in (first, good1, good2)] == [200] * 3
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_image"
    assert listed.status_code == 400 and listed.json()["error"]["message"].startswith("item 1: ")
    assert max(server.state.runtime.executors[0].batches) >= 2  # decoded and run as a batch


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_front_ends_pass_jpeg_bytes_to_the_engine_through_their_slots(
    tiny_config: Path, tmp_path: Path
) -> None:
    args = [
        "--workers",
        "2",
        "--decode",
        "gpu",
        "--backend",
        "fake",
        "--model",
        str(tiny_config),
        "--pretrained",
        "none",
        "--gpus",
        "cpu",
    ]
    with cli_server(args, tmp_path / "server.log") as (_, url):
        files = [("image", jpeg(1)), ("image", jpeg(2, (224, 224))), ("image", jpeg(3))]
        r = httpx.post(url + "/embed", files=files, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["embeddings"]) == 3
        bad = httpx.post(
            url + "/embed", files=[("image", jpeg(1)), ("image", corrupt_huffman(jpeg(4)))]
        )
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("item 1: ")


def test_a_request_gone_while_its_batch_decodes_does_not_stop_the_worker() -> None:
    """The bad image's request is cancelled while the device thread decodes its batch: its
    error has nobody to go to, and the worker must go on (it once raised and died)."""
    from clipserve.backends.fake import FakeExecutor
    from clipserve.batching import Batcher
    from clipserve.config import BatchingConfig
    from clipserve.inference.gpu_decode import DeviceDecoder
    from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
    from clipserve.metrics import Metrics

    spec = PreprocessSpec((224, 224), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    host = ImageDecoder(spec, 40_000_000)
    big = [np.frombuffer(jpeg(seed, (2400, 1800)), np.uint8) for seed in range(6)]
    bad = np.frombuffer(corrupt_huffman(jpeg(9)), np.uint8)

    async def main() -> None:
        batcher = Batcher(
            [FakeExecutor(spec, 16)],
            BatchingConfig(16, 64, 0.0),
            Metrics(),
            decoders=[DeviceDecoder(host, "cpu")],
        )
        batcher.start()
        try:
            good_ticket, bad_ticket = batcher.admit(6), batcher.admit(1)
            good = asyncio.create_task(
                batcher.run(good_ticket, big, normalize=True, request_id="good")
            )
            gone = asyncio.create_task(
                batcher.run(bad_ticket, [bad], normalize=True, request_id="gone")
            )
            # One batch of seven taken by the worker, decoding on the device thread.
            await until_async(lambda: batcher.workers[0].in_flight == 7)
            gone.cancel()
            assert len((await good).embeddings) == 6
            assert all(w.alive for w in batcher.workers)
            again = batcher.admit(1)
            assert (
                len(
                    (
                        await batcher.run(again, big[:1], normalize=True, request_id="again")
                    ).embeddings
                )
                == 1
            )
        finally:
            await batcher.stop()

    asyncio.run(main())
