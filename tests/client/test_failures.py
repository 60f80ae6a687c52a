"""Each failure class, from real servers: 503s retried no sooner than Retry-After, 504 and 429
and a closed port as the client's own exceptions, the API key and deadline headers as a proxy
in front of the server would see them; and the retry policy's numbers."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from clipserve.client import (
    Client,
    ClientError,
    Overloaded,
    RequestTimedOut,
    ServerError,
    ServerGone,
    Unauthorized,
)
from clipserve.client.retry import RetryPolicy, parse_retry_after
from clipserve.loadgen.procs import free_port
from tests.client.conftest import ProxyPage, Recording, WrongEncoding
from tests.helpers import Serve, marked_png


def test_503s_are_retried_no_sooner_than_retry_after(serve: Serve) -> None:
    # One batch computes for 400 ms while the queue holds one request more: of four
    # requests sent at once, the last ones are refused until room comes back.
    server = serve(
        backend="fake",
        backend_option=["latency_ms=400"],
        max_batch_size=2,
        max_queue_size=2,
        max_items_per_request=2,
    )
    images = [marked_png(m, seed=m) for m in range(8)]
    recording = Recording()
    with Client(server.url, concurrency=4, transport=recording) as c:
        vectors = c.embed_images(images)
    assert vectors.shape == (8, 32) and not (vectors != vectors).any()
    sent = recording.to("/embed")
    refused = [e for e in sent if e.status == 503]
    assert refused, [e.status for e in sent]
    assert len([e for e in sent if e.status == 200]) == 4
    for e in refused:
        assert e.retry_after is not None and int(e.retry_after) >= 1
        again = next(r for r in sent if r.body == e.body and r.sent > e.answered)
        assert again.sent - e.answered >= int(e.retry_after)


def test_a_server_deadline_is_a_request_timeout(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=1000"], request_timeout_s=0.3)
    with Client(server.url) as c, pytest.raises(RequestTimedOut, match=r"timed out|timeout"):
        c.embed_images([marked_png(1)])


def test_the_client_deadline_is_sent_and_ends_in_a_request_timeout(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=1000"])
    recording = Recording()
    with Client(server.url, timeout_s=0.25, transport=recording) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestTimedOut):
            c.embed_images([marked_png(1)])
    assert time.monotonic() - t0 < 1.0  # the server's 504 at 250 ms, not the fake's second
    (embed,) = recording.to("/embed")
    assert embed.headers["x-request-timeout-ms"] == "250" and embed.status == 504


def test_a_closed_port_is_server_gone_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    recording = Recording()
    with pytest.raises(ServerGone, match=r"127\.0\.0\.1"):
        Client(url, retries=2, transport=recording)
    assert recording.exchanges == []
    assert [(path, type(e).__name__) for path, e in recording.failures] == [
        ("/info", "ConnectError")
    ] * 3  # the first attempt and two retries
    assert issubclass(ServerGone, ClientError)


def test_rate_limited_is_overloaded_when_retries_run_out(serve: Serve) -> None:
    server = serve(backend="fake", rate_limit="0.01:2")  # two items, then one per 100 s
    with Client(server.url, retries=0) as c:
        c.embed_images([marked_png(1), marked_png(2)])
        with pytest.raises(Overloaded, match="429 rate_limit_exceeded"):
            c.embed_images([marked_png(3)])


def test_the_api_key_is_sent_as_a_bearer_token(serve: Serve, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("photos:photo-app-key-0001\n")
    server = serve(backend="fake", api_keys=str(keys))
    recording = Recording()
    with Client(server.url, api_key="photo-app-key-0001", transport=recording) as c:
        assert c.embed_images([marked_png(1)]).shape == (1, 32)
    assert {e.headers["authorization"] for e in recording.exchanges} == {
        "Bearer photo-app-key-0001"
    }
    assert {e.headers["x-request-timeout-ms"] for e in recording.exchanges} == {"60000"}
    with pytest.raises(Unauthorized, match=r"401|key"):
        Client(server.url)
    with pytest.raises(Unauthorized):
        Client(server.url, api_key="not-a-known-key")


def test_an_answer_that_does_not_decode_is_a_server_error(serve: Serve) -> None:
    """A proxy labels the server's answer gzip: the client's own error, no httpx type."""
    server = serve(backend="fake")
    with Client(server.url, transport=WrongEncoding()) as c, pytest.raises(ServerError) as raised:
        c.embed_images([marked_png(1)])
    assert (raised.value.status, raised.value.code) == (0, "unreadable_answer")
    assert "POST /embed" in raised.value.message


@pytest.mark.parametrize(
    ("page", "content_type", "image_format"),
    [
        (b"<html><body>Please sign in</body></html>", "text/html", "encoded"),
        (b"\xff\xfe not text", "application/json", "encoded"),
        (b'["a list"]', "application/json", "encoded"),
        (b'{"status": "ok"}', "application/json", "encoded"),  # an object, not a model card
        (b'{"status": "ok"}', "application/json", "tensor"),  # an object, not a model card
    ],
)
def test_an_info_answer_that_is_not_a_model_card_is_a_server_error(
    serve: Serve, page: bytes, content_type: str, image_format: str
) -> None:
    """A proxy answers /info itself: the client's own error, no JSON or Key error."""
    server = serve(backend="fake")
    proxy = ProxyPage(body=page, content_type=content_type)
    with pytest.raises(ServerError) as raised:
        Client(server.url, transport=proxy, image_format=image_format)  # type: ignore[arg-type]
    assert (raised.value.status, raised.value.code) == (200, "bad_answer")
    assert "GET /info" in raised.value.message


def test_the_retry_policy_backs_off_exponentially_with_jitter() -> None:
    policy, rng = RetryPolicy(retries=5), random.Random(0)
    for attempt, ceiling in enumerate([0.25, 0.5, 1, 2, 4, 8, 8]):
        waits = [policy.delay(attempt, None, rng) for _ in range(200)]
        assert ceiling / 2 <= min(waits) and max(waits) <= ceiling
        assert max(waits) - min(waits) > ceiling / 4  # jittered, not one value
    assert all(3 <= policy.delay(0, 3, rng) <= 3.6 for _ in range(100))
    assert policy.delay(0, 3600, rng) == 60  # a server asking for an hour gets a minute
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:05 GMT", now) == 5
    assert parse_retry_after("7") == 7
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


@pytest.mark.parametrize(
    ("status", "code"), [(408, "body_timeout"), (504, "timeout"), (500, "internal")]
)
def test_a_body_or_answer_past_the_deadline_is_a_request_timeout(status: int, code: str) -> None:
    """408 (the body arrived too slowly: a stalled upload) and 504 (the answer came too late)
    both spend the deadline: neither is retried, both are `RequestTimedOut`; a 500 is not."""
    from clipserve.client.remote import _refused
    from clipserve.client.wire import Refusal
    from clipserve.protocol.responses import encode_error

    refusal = Refusal.of(status, encode_error(code, "request body not received within 1 s"))
    error = _refused(refusal, items=1, what="POST /embed", splittable=False)
    assert isinstance(error, RequestTimedOut) == (status != 500), error


def test_a_500_fails_only_the_image_that_causes_it(serve: Serve) -> None:
    """The server fails a batch's items together when one breaks it: the client sends the
    request again in halves, down to that image, and the checked call keeps the rest."""
    server = serve(backend="fake", backend_option=["fail_pixel=7"])
    marks = [100 + i for i in range(10)]
    marks[6] = 7
    images = [marked_png(m, seed=i) for i, m in enumerate(marks)]
    recording = Recording()
    with Client(server.url, batch_size=10, transport=recording) as c:
        checked = c.embed_images_checked(images)
        alone = c.embed_images([images[0]])
    assert list(checked.errors) == [6]
    assert "the server failed on it" in checked.errors[6] and "500" in checked.errors[6]
    assert np.isnan(checked.vectors[6]).all()
    assert np.isfinite(np.delete(checked.vectors, 6, axis=0)).all()
    np.testing.assert_allclose(checked.vectors[0], alone[0], atol=1e-6)
    posts = [e for e in recording.exchanges if e.path == "/embed"]
    # 0-9 fail; 0-4 pass, 5-9 fail; 5-6 fail, 5 passes, 6 fails; 7-9 pass; the lone one.
    assert [e.status for e in posts] == [500, 200, 500, 500, 200, 500, 200, 200]


def test_a_server_that_fails_every_image_ends_the_checked_call(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["fail_pixel=7"])
    images = [marked_png(7, seed=i) for i in range(40)]
    with Client(server.url, batch_size=8, concurrency=1) as c, pytest.raises(ServerError) as e:
        c.embed_images_checked(images)
    assert e.value.status == 500 and "8 in a row" in e.value.message
