"""Image URLs fetched with --allow-url-fetch, against a real image server on loopback: what is
allowed works on /v1/embeddings and /embed; unlisted hosts, private addresses (directly or by
redirect), oversize, slow and non-image bodies are 4xx naming the item, and nothing is fetched
that should not be."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from clipserve.errors import ImageUrlForbidden
from clipserve.http.fetch import AllowList
from clipserve.loadgen.procs import free_port
from tests.helpers import Serve, embed_image, png_bytes, random_pixels, uvicorn_thread

IMAGE = png_bytes(random_pixels(7))


class ImageServer:
    """Serves IMAGE and the ways a fetch can go wrong; counts what it was asked."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()
        self.app = Starlette(routes=[Route("/{name}", self.serve)])

    async def serve(self, request: Request) -> Response:
        name = request.path_params["name"]
        with self._lock:
            self.hits.append(name)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._answer(name, request)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _answer(self, name: str, request: Request) -> Response:
        if name == "cat.png":
            return Response(IMAGE, media_type="text/plain")  # the type is sniffed, not trusted
        if name == "held.png":  # answers once released: concurrency is seen, not timed
            await asyncio.sleep(0.3)
            return Response(IMAGE)
        if name == "hop":
            return RedirectResponse(f"/{request.query_params['to']}")
        if name == "to-private":
            return RedirectResponse("http://10.1.2.3/cat.png")
        if name == "to-metadata":
            return RedirectResponse("http://169.254.169.254/latest/meta-data/")
        if name == "loop":
            return RedirectResponse("/loop")
        if name == "big":
            return Response(IMAGE + b"\0" * 5000, media_type="image/png")
        if name == "big-stream":  # no Content-Length: the cap holds on what arrives

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(100):
                    yield b"\0" * 4096  # 400 KiB, over the cap

            return StreamingResponse(chunks(), media_type="image/png")
        if name == "slow":

            async def trickle() -> AsyncIterator[bytes]:
                yield IMAGE[:10]
                await asyncio.sleep(30)
                yield IMAGE[10:]

            return StreamingResponse(trickle(), media_type="image/png")
        if name == "text.png":
            return Response(b"<html>not an image</html>", media_type="image/png")
        return Response(b"", status_code=404)


@pytest.fixture(scope="module")
def images() -> Iterator[tuple[ImageServer, str]]:
    server = ImageServer()
    config = uvicorn.Config(server.app, host="127.0.0.1", port=free_port(), log_level="warning")
    with uvicorn_thread(uvicorn.Server(config)) as url:
        yield server, url


def test_allowed_urls_are_fetched_on_both_doors(
    serve: Serve, images: tuple[ImageServer, str]
) -> None:
    source, base = images
    server = serve(allow_url_fetch=["127.0.0.1/32"], url_max_bytes=len(IMAGE) + 100)
    want = embed_image(server, IMAGE)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as client:
        r = client.embeddings.create(model="tiny-clip", input=["a cat", f"{base}/cat.png"])
    np.testing.assert_allclose(r.data[1].embedding, want, atol=1e-5)
    r2 = httpx.post(server.url + "/embed", json={"images": [f"{base}/hop?to=cat.png"]})
    assert r2.status_code == 200, r2.text
    np.testing.assert_allclose(r2.json()["embeddings"][0], want, atol=1e-5)
    assert "fetch;dur=" in r2.headers["server-timing"]  # its own stage, and histogram label
    metrics = httpx.get(server.url + "/metrics").text
    assert (
        'clipserve_stage_duration_seconds_count{protocol="json-urls",stage="fetch"} 1.0' in metrics
    )
    assert source.hits.count("cat.png") == 2 and "hop" in source.hits


@pytest.mark.parametrize(
    ("path", "status", "code", "message"),
    [
        ("to-private", 400, "image_url_refused", "non-public address 10.1.2.3"),
        ("to-metadata", 400, "image_url_refused", "169.254.169.254"),
        ("loop", 400, "image_fetch_failed", "more than 3 redirects"),
        # OpenAI's rule: a per-item limit is a 400 there (/embed would say 413).
        ("big", 400, "image_too_large", "--url-max-bytes"),
        ("big-stream", 400, "image_too_large", "--url-max-bytes"),
        ("slow", 400, "image_fetch_failed", "took over 1 s"),
        ("text.png", 400, "image_fetch_failed", "not a JPEG, PNG or WebP"),
        ("missing.png", 400, "image_fetch_failed", "HTTP 404"),
    ],
)
def test_fetch_failures_are_4xx_naming_the_item(
    serve: Serve, images: tuple[ImageServer, str], path: str, status: int, code: str, message: str
) -> None:
    _, base = images
    server = serve(allow_url_fetch=["127.0.0.1/32"], url_timeout_s=1, url_max_bytes=len(IMAGE))
    body = {"model": "tiny-clip", "input": ["a cat", "a dog", f"{base}/{path}"]}
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == "input"
    assert error["message"].startswith("item 2: ") and message in error["message"], error


def test_unlisted_and_private_hosts_are_never_contacted(
    serve: Serve, images: tuple[ImageServer, str]
) -> None:
    source, base = images
    port = base.rsplit(":", 1)[1]
    # Listed by name only: "localhost" resolves to loopback, which needs its CIDR listed too.
    server = serve(allow_url_fetch=["images.example.org,localhost"])
    before = len(source.hits)
    for url in (f"{base}/cat.png", f"http://localhost:{port}/cat.png", "http://[::1]/x.png"):
        r = httpx.post(server.url + "/embed", json={"images": [url]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "image_url_refused", r.text
    assert len(source.hits) == before  # refused before any connection


def test_hosts_written_in_other_digits_are_checked_as_the_address_they_reach(
    serve: Serve, images: tuple[ImageServer, str]
) -> None:
    """aiohttp reads the host as IDNA does: circled and fullwidth digits are 127.0.0.1 there,
    though urllib reads a name. The check reads it as aiohttp does, redirects too."""
    source, base = images
    port = base.rsplit(":", 1)[1]
    server = serve(allow_url_fetch=["8.8.8.0/24"])  # a CIDR: names are resolved, not refused
    before = len(source.hits)
    fullwidth = "".join(chr(0xFF10 + int(c)) if c.isdigit() else c for c in "127.0.0.1")
    for host in ("①②⑦.0.0.1", fullwidth, "①⑥⑨.②⑤④.①⑥⑨.②⑤④"):
        r = httpx.post(server.url + "/embed", json={"images": [f"http://{host}:{port}/cat.png"]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "image_url_refused", r.text
        assert "non-public address" in r.json()["error"]["message"], r.text
    assert len(source.hits) == before  # refused before any connection
    for bad in ("a" * 64 + ".example.com", "a..example.com"):  # labels the resolver refuses
        r = httpx.post(server.url + "/embed", json={"images": [f"http://{bad}/x.png"]})
        assert r.status_code == 400, r.text  # was a 500: getaddrinfo's UnicodeError
        assert r.json()["error"]["code"] == "image_url_refused", r.text


def test_an_unlisted_name_is_refused_without_asking_the_dns(serve: Serve) -> None:
    """With names listed and no CIDR, no address could allow an unlisted name: it is refused
    unresolved, so a client cannot make the server look up names it chooses (data carried
    out in DNS queries). `.invalid` never resolves: a lookup would fail as a fetch, not be
    refused."""
    server = serve(allow_url_fetch=["images.example.org"])
    r = httpx.post(server.url + "/embed", json={"images": ["http://secret-data.invalid/x.png"]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "image_url_refused", r.text
    assert "not in --allow-url-fetch" in error["message"]


def test_fetches_are_bounded_per_process(serve: Serve, images: tuple[ImageServer, str]) -> None:
    source, base = images
    server = serve(allow_url_fetch=["127.0.0.1/32"], url_fetch_concurrency=1)
    source.most_in_flight = 0
    urls = [f"{base}/held.png?n={i}" for i in range(3)]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": urls, "model": "tiny-clip"})
    assert r.status_code == 200, r.text
    assert source.most_in_flight == 1


def test_allow_list_rules() -> None:
    allow = AllowList.parse(["*.example.org, 203.0.113.0/24", "10.0.0.0/8", "169.254.169.254/32"])
    ip = ipaddress.ip_address
    allow.check("cdn.example.org", ip("93.184.216.34"))  # a listed name, a public address
    allow.check("anything", ip("203.0.113.9"))  # a listed CIDR
    allow.check("internal", ip("10.2.3.4"))  # private, but its CIDR is listed
    allow.check("metadata", ip("169.254.169.254"))  # listed exactly
    for host, address, why in [
        ("example.com", "93.184.216.34", "not in --allow-url-fetch"),
        ("cdn.example.org", "127.0.0.1", "non-public"),  # a listed name rebound to loopback
        ("cdn.example.org", "192.168.1.1", "non-public"),
        ("x.example.org", "fd00:ec2::254", "non-public"),
        # IPv6 forms that reach an IPv4 host: judged by that host (NAT64, 6to4, mapped).
        ("cdn.example.org", "64:ff9b::ac10:1", "non-public address 172.16.0.1"),
        ("cdn.example.org", "2002:7f00:1::", "non-public address 127.0.0.1"),
        ("cdn.example.org", "::ffff:192.168.0.1", "non-public address 192.168.0.1"),
    ]:
        with pytest.raises(ImageUrlForbidden, match=why):
            allow.check(host, ip(address))
    wide = AllowList.parse(["169.254.0.0/16"])
    with pytest.raises(ImageUrlForbidden):  # metadata needs its exact address listed
        wide.check("m", ip("169.254.169.254"))
    assert not AllowList.parse([]) and not AllowList.parse([" , "])
