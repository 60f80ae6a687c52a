"""The client against a real tiny-model server: the same vectors as the model in-process,
requests packed within the server's limits, bad items named by file and global index, and
every good item embedded around the bad ones. Sync and async clients alike."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from clipserve.client import AsyncClient, Client, Embedded, ImageInput, InvalidInput
from tests.client.conftest import BodyLimit
from tests.helpers import (
    RunningServer,
    Serve,
    corrupt_huffman,
    marked_png,
    metric,
    min_cosine,
    random_pixels,
)

EMBED_OK = 'clipserve_requests_total{route="/embed",status="200"}'
EMBED_BAD = 'clipserve_requests_total{route="/embed",status="400"}'


def requests_to(server: RunningServer, name: str = EMBED_OK) -> int:
    try:
        return int(metric(server, name))
    except AssertionError:  # not counted yet
        return 0


@pytest.fixture(scope="module")
def client(module_server: RunningServer) -> Iterator[Client]:
    with Client(module_server.url, batch_size=32) as c:
        yield c


def test_remote_matches_local_and_packs_within_max_items_per_request(
    module_server: RunningServer, client: Client, local_client: Client, photos: list[Path]
) -> None:
    assert client.mode_in_use == "remote"
    before = requests_to(module_server)
    remote = client.embed_images(photos)  # 20 images, 8 per request at most (module_server)
    assert requests_to(module_server) - before == 3
    local = local_client.embed_images(photos)
    assert remote.shape == (20, 32) and remote.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(remote, axis=1), 1, atol=1e-5)
    assert min_cosine(remote, local) >= 0.9999
    np.testing.assert_allclose(remote, local, atol=1e-5)
    texts = ["a photo of a cat", "a dog", "near-duplicate photos"]
    np.testing.assert_allclose(
        client.embed_texts(texts), local_client.embed_texts(texts), atol=1e-5
    )
    # Every input kind gives the same vector: a path, its bytes, its pixels as an array.
    pixels = np.asarray(Image.open(photos[3]))
    mixed = client.embed_images([str(photos[3]), photos[3].read_bytes(), pixels])
    np.testing.assert_allclose(mixed, remote[[3, 3, 3]], atol=1e-6)


def test_tensor_mode_crops_on_the_client_as_the_server_does(
    module_server: RunningServer, client: Client
) -> None:
    big = Image.fromarray(random_pixels(7, size=300)).resize((400, 300))  # resized and cropped
    jpeg = io.BytesIO()
    big.save(jpeg, "JPEG", quality=90)
    images: list[ImageInput] = [jpeg.getvalue(), marked_png(1), random_pixels(3, size=100)]
    encoded = client.embed_images(images)
    with Client(module_server.url, image_format="tensor") as tensor:
        np.testing.assert_allclose(tensor.embed_images(images), encoded, atol=1e-5)
        bad = tensor.embed_images_checked([b"not an image", marked_png(1)])
    assert list(bad.errors) == [0] and "not a JPEG, PNG or WebP" in bad.errors[0]
    np.testing.assert_allclose(bad.vectors[1], encoded[1], atol=1e-5)


def test_a_smaller_batch_size_and_the_body_limit_both_split_requests(
    module_server: RunningServer, serve: Serve, photos: list[Path]
) -> None:
    before = requests_to(module_server)
    with Client(module_server.url, batch_size=5) as c:
        reference = c.embed_images(photos)
    assert requests_to(module_server) - before == 4
    sizes = [p.stat().st_size for p in photos]  # ~150 kB of noise each
    small = serve(max_body_bytes=2 * max(sizes) + 1000)  # two images per body at most
    with Client(small.url, batch_size=32) as c:
        assert c.info()["limits"]["max_body_bytes"] == small.config.limits.max_body_bytes
        np.testing.assert_allclose(c.embed_images(photos[:6]), reference[:6], atol=1e-6)
        too_big = c.embed_images_checked([b"\xff\xd8" + b"\0" * small.config.limits.max_body_bytes])
    assert requests_to(small) == 3
    assert "--max-body-bytes" in too_big.errors[0]


def test_a_proxy_body_limit_lower_than_the_servers_splits_requests_in_halves(
    module_server: RunningServer, client: Client, photos: list[Path]
) -> None:
    proxy = BodyLimit(2 * max(p.stat().st_size for p in photos) + 1000)  # two images a body
    with Client(module_server.url, transport=proxy) as c:
        vectors = c.embed_images(photos[:8])  # one request of 8, two of 4, four of 2
        huge = c.embed_images_checked([marked_png(1), b"\xff\xd8" + b"\0" * proxy.limit])
    np.testing.assert_allclose(vectors, client.embed_images(photos[:8]), atol=1e-6)
    assert [e.status for e in proxy.inner.to("/embed")] == [200] * 5
    assert huge.errors == {1: "<bytes #1>: <html>413 Request Entity Too Large</html>"}


def test_invalid_input_names_the_first_bad_file_with_its_global_index(
    module_server: RunningServer, photos: list[Path], tmp_path: Path
) -> None:
    bad = [tmp_path / "bad-06.png", tmp_path / "bad-13.png"]
    for path in bad:
        path.write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    images = [*photos[:6], bad[0], *photos[6:12], bad[1], *photos[12:]]
    with Client(module_server.url, batch_size=4, concurrency=4) as c:
        with pytest.raises(InvalidInput) as raised:
            c.embed_images(images)
        e = raised.value
        assert (e.index, e.source) == (6, str(bad[0]))
        assert str(bad[0]) in str(e) and "not a JPEG, PNG or WebP" in e.message
        with pytest.raises(InvalidInput) as raised:
            c.embed_images(images[7:])  # the other one, now at index 6
        assert (raised.value.index, raised.value.source) == (6, str(bad[1]))


def test_checked_embeds_every_good_item_around_the_bad_ones(
    module_server: RunningServer, client: Client, photos: list[Path], tmp_path: Path
) -> None:
    jpeg = io.BytesIO()
    Image.fromarray(random_pixels(5)).save(jpeg, "JPEG")
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(corrupt_huffman(jpeg.getvalue()))
    text = tmp_path / "notes.jpg"
    text.write_text("a text file, not a photo\n")
    missing = tmp_path / "gone.jpg"
    images: list[ImageInput] = [*photos[:5], corrupt, *photos[5:11], text, missing, *photos[11:]]
    images += [np.zeros((4, 4), np.uint8)]  # not HxWx3
    good = [i for i, item in enumerate(images) if isinstance(item, Path) and item in photos]
    before_ok, before_bad = requests_to(module_server), requests_to(module_server, EMBED_BAD)
    done = client.embed_images_checked(images)
    assert isinstance(done, Embedded)
    assert sorted(done.errors) == [5, 12, 13, 23]
    assert done.errors[5].startswith(f"{corrupt}: ") and "corrupt" in done.errors[5]
    assert done.errors[12].startswith(f"{text}: ") and "not a JPEG" in done.errors[12]
    assert done.errors[13].startswith(f"{missing}: cannot read")
    assert done.errors[23].startswith("<array #23>: expected an HxWx3 uint8 array")
    assert np.isnan(done.vectors[list(done.errors)]).all()
    np.testing.assert_allclose(done.vectors[good], client.embed_images(photos), atol=1e-6)
    # 22 sent in 3 requests of 8; each server-side bad item cost one refused request
    assert requests_to(module_server, EMBED_BAD) - before_bad == 2
    assert requests_to(module_server) - before_ok == 3 + 3


def test_info_is_the_servers(module_server: RunningServer, client: Client) -> None:
    assert client.info() == httpx.get(module_server.url + "/info").json()


def test_async_client_gives_what_the_sync_one_gives(
    module_server: RunningServer, client: Client, photos: list[Path]
) -> None:
    bad: list[ImageInput] = [*photos[:9], b"junk", *photos[9:]]

    async def run() -> tuple[np.ndarray, Embedded, np.ndarray, InvalidInput, str]:
        async with AsyncClient(module_server.url, batch_size=4) as c:
            vectors = await c.embed_images(photos)
            checked = await c.embed_images_checked(bad)
            texts = await c.embed_texts(["a cat", "a dog"])
            with pytest.raises(InvalidInput) as raised:
                await c.embed_images(bad)
            return vectors, checked, texts, raised.value, c.mode_in_use

    vectors, checked, texts, error, mode = asyncio.run(run())
    assert mode == "remote"
    np.testing.assert_allclose(vectors, client.embed_images(photos), atol=1e-6)
    want = client.embed_images_checked(bad)
    assert checked.errors == want.errors == {9: "<bytes #9>: not a JPEG, PNG or WebP image"}
    np.testing.assert_allclose(checked.vectors, want.vectors, atol=1e-6)
    np.testing.assert_allclose(texts, client.embed_texts(["a cat", "a dog"]), atol=1e-6)
    assert (error.index, error.source) == (9, "<bytes #9>")


def test_texts_over_the_context_name_their_global_index(client: Client) -> None:
    texts = ["short"] * 10 + ["word " * 100] + ["short"]
    with pytest.raises(InvalidInput) as raised:
        client.embed_texts(texts)
    assert (raised.value.index, raised.value.source) == (10, "<text #10>")
    assert "context" in raised.value.message
    with pytest.raises(TypeError):
        client.embed_texts("one string")


def test_an_item_of_no_image_type_is_a_bad_item_in_both_modes(
    client: Client, local_client: Client
) -> None:
    """None or a PIL image in a checked call is that item's error, not a TypeError for all."""
    items: list[Any] = [marked_png(1), None, Image.new("RGB", (8, 8)), marked_png(2)]
    done, local = client.embed_images_checked(items), local_client.embed_images_checked(items)
    assert done.errors == local.errors
    assert done.errors == {
        1: "<NoneType #1>: expected a path, bytes or an HxWx3 uint8 array, got NoneType",
        2: "<Image #2>: expected a path, bytes or an HxWx3 uint8 array, got Image",
    }
    assert np.isfinite(done.vectors[[0, 3]]).all()
    with pytest.raises(InvalidInput) as raised:
        client.embed_images(items)
    assert (raised.value.index, raised.value.source) == (1, "<NoneType #1>")


def test_a_text_that_is_not_valid_unicode_is_refused_alike_in_both_modes(
    client: Client, local_client: Client
) -> None:
    """A lone surrogate cannot be sent as UTF-8: InvalidInput naming it, remote and local."""
    texts = ["a cat", "bad \ud800 text"]
    for c in (client, local_client):
        with pytest.raises(InvalidInput) as raised:
            c.embed_texts(texts)
        assert (raised.value.index, raised.value.source) == (1, "<text #1>")
        assert "surrogate" in raised.value.message
