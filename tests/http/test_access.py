"""API keys, per-key rate limits and HTTPS (issue 20): the key file, the shared buckets, and the
answers through the real openai client, tritonclient's error shape and plain httpx against real
uvicorn. Rates are a token per 100 s or slower, so a loaded machine refills nothing mid-test."""

from __future__ import annotations

import base64
import logging
import os
import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from clipserve.errors import ConfigError, StartupError
from clipserve.http.app import create_app
from clipserve.http.buckets import BucketTable
from clipserve.http.keys import Rate, parse_keys, parse_rate
from clipserve.http.server import build_uvicorn_config
from clipserve.loadgen.procs import free_port
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    cli_server,
    make_config,
    marked_png,
    metric,
    model_name,
    running,
    self_signed_cert,
    until,
    uvicorn_thread,
)

KEY_A, KEY_B, KEY_B2, KEY_C, KEY_D, KEY_E, KEY_F, KEY_G = (
    f"key-{c * 4}-{i}" for i, c in enumerate("abxcdefg")
)
UNNAMED = "unnamed-key-0001"
KEYS = f"""# teams
team-a:{KEY_A}
team-b:{KEY_B}:0.01:2
team-b:{KEY_B2}:0.01:2

team-c:{KEY_C}:0.01:3
team-d:{KEY_D}:0.01:1
team-e:{KEY_E}:0.25:3
team-f:{KEY_F}:0.01:3
team-g:{KEY_G}:0.01:1
{UNNAMED}
"""
PROBES = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", "/health")
NIM_PROBES = ("/v1/health/live", "/v1/health/ready")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def texts(n: int) -> dict[str, list[str]]:
    return {"texts": [f"text {i}" for i in range(n)]}


@pytest.fixture(scope="module")
def server(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    config = make_config(tiny_config, tiny_checkpoint, backend="fake", api_keys=str(keys))
    with running(config) as s:
        yield s


# ---- the key file and the buckets -------------------------------------------------------------


def test_key_file_lines_names_rates_and_hashes() -> None:
    ring = parse_keys(KEYS, "keys.txt", Rate(5, 10))
    assert len(ring) == 9
    a, b, b2, unnamed = (ring.find(k.encode()) for k in (KEY_A, KEY_B, KEY_B2, UNNAMED))
    assert a is not None and a.label == "team-a" and a.rate == Rate(5, 10)  # the default
    assert b is not None and b2 is not None and b.bucket == b2.bucket  # one name, one quota
    assert b.rate == Rate(0.01, 2) and b.bucket != a.bucket
    assert unnamed is not None and unnamed.label.startswith("sha256:") and len(unnamed.label) == 15
    assert ring.find(b"key-aaaa-") is None and ring.find(KEY_A.encode() + b" ") is None
    assert all(KEY_A.encode() not in digest for digest in ring.grants)  # hashes only
    assert parse_rate("3", "x") == Rate(3, 3) and parse_rate("0.5", "x") == Rate(0.5, 1)


def test_the_documented_key_file_loads_and_comments_may_follow_a_key() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    example = docs.split("## API keys and rate limits", 1)[1].split("```")[1]
    ring = parse_keys(example, "operations.md", Rate(5, 10))
    assert len(ring) == 4 and {g.label for g in ring.grants.values()} >= {"batch-jobs"}
    ring = parse_keys("team:key-12345678   # the search team\nkey-abc#defg", "x", None)
    assert ring.find(b"key-12345678") is not None and ring.find(b"key-abc#defg") is not None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a:b:c:d:e:f", "line 1: expected KEY"),
        ("short", "at least 8"),
        ("bad name:key-12345678", "a name is"),
        ("a:key-12345678\nb:key-12345678", "line 2: the same key"),
        ("a:key-12345678:1\na:key-87654321:2", "another rate"),
        ("a:key-12345678:fast", "RATE or RATE:BURST"),
        ("a:key-12345678:0", "must be positive"),
        ("a:key-12345678:1:0", "burst at least 1"),
        ("# a file caught mid-write\n\n", "holds no keys"),
    ],
)
def test_bad_key_files_name_the_line(text: str, problem: str) -> None:
    with pytest.raises(StartupError, match=problem):
        parse_keys(text, "k", None)


def test_bad_key_file_or_rate_fails_create_app(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "keys.txt"
    bad.write_text("team:key-12345678:1:2:3:4\n")
    for flags, problem in [
        ({"api_keys": str(bad)}, "keys.txt, line 1"),
        ({"api_keys": str(tmp_path / "missing")}, "cannot read"),
    ]:
        config = make_config(tiny_config, tiny_checkpoint, backend="fake", **flags)
        with pytest.raises(StartupError, match=problem):
            create_app(config, registry=CollectorRegistry())
    for flags, problem in [
        ({"rate_limit": "0"}, "--rate-limit: expected RATE or RATE:BURST"),
        ({"rate_limit": "5:0"}, "both positive"),
        ({"protect_metrics": "true"}, "--protect-metrics: needs --api-keys"),
    ]:
        with pytest.raises(ConfigError, match=problem):
            make_config(tiny_config, tiny_checkpoint, **flags)


def test_buckets_are_shared_through_the_file_and_refill(tmp_path: Path) -> None:
    path = str(tmp_path / "quota")
    one, two = BucketTable(path, create=True), BucketTable(path)  # two front ends
    try:
        slow, bucket = Rate(0.001, 3), b"b" * 16
        assert one.take(bucket, 2, 2, slow) == 0 and two.take(bucket, 1, 1, slow) == 0
        wait = one.take(bucket, 1, 1, slow)
        assert 990 < wait <= 1000  # a token per 1000 s, none left
        assert two.available(b"c" * 16, slow) == 3  # another bucket: full
        two.give_back(bucket, 1, slow)
        assert one.take(bucket, 1, 1, slow) == 0
        fast = Rate(1e9, 2)  # refilled at once
        assert one.take(bucket, 2, 2, fast) == 0 and one.available(bucket, fast) == 2
    finally:
        one.close()
        two.close()
        BucketTable.remove(path)


# ---- 401 -------------------------------------------------------------------------------------


def test_no_key_or_a_wrong_one_is_401_in_each_doors_shape(server: RunningServer) -> None:
    name = model_name(server)
    cases = [
        ("/embed", {"Content-Type": "image/png"}, marked_png(1)),
        ("/v1/embeddings", {}, b'{"model": "m", "input": "a cat"}'),
        (f"/v2/models/{name}/infer", {}, b"{}"),
        ("/embeddings", {}, b"{}"),  # Infinity's path: OpenAI's shape
    ]
    for path, headers, body in cases:
        for key in ({}, bearer("key-wrong-000"), {"X-API-Key": "key-wrong-000"}):
            r = httpx.post(server.url + path, content=body, headers={**headers, **key})
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and "x-request-id" in r.headers
            error = r.json()["error"]
            if path.startswith("/v2"):
                assert isinstance(error, str) and "API key" in error
            elif path == "/embed":
                assert error["code"] == "invalid_api_key" and set(error) == {"code", "message"}
            else:
                assert error["code"] == "invalid_api_key" and error["param"] is None
                assert error["type"] == "invalid_request_error"
    assert "required" in httpx.get(server.url + "/info").json()["error"]["message"]


def test_keys_by_bearer_or_x_api_key(server: RunningServer) -> None:
    for headers in (bearer(KEY_A), {"X-API-Key": KEY_A}, {"X-API-Key": UNNAMED}):
        r = httpx.post(server.url + "/embed", content=marked_png(2), headers={**PNG, **headers})
        assert r.status_code == 200, r.text
    r = httpx.get(server.url + "/v1/models", headers={"authorization": f"bearer {KEY_A}"})
    assert r.status_code == 200 and r.json()["data"]
    # Another scheme in Authorization is no key; X-API-Key beside it still counts.
    basic = {"Authorization": f"Basic {KEY_A}"}
    assert httpx.get(server.url + "/info", headers=basic).status_code == 401
    assert httpx.get(server.url + "/info", headers={**basic, "X-API-Key": KEY_A}).is_success


def test_openai_client_raises_authentication_error(server: RunningServer) -> None:
    name = model_name(server)
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with wrong as c, pytest.raises(openai.AuthenticationError) as caught:
        c.embeddings.create(model=name, input="a cat")
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0) as c:
        assert len(c.embeddings.create(model=name, input=["a", "b"]).data) == 2


def test_probes_and_metrics_stay_open(server: RunningServer) -> None:
    for path in (*PROBES, *NIM_PROBES, "/metrics", "/v1/metrics"):
        assert httpx.get(server.url + path).status_code == 200, path


def test_protect_metrics_needs_a_key_for_metrics_only(serve: Serve, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    s = serve(backend="fake", api_keys=str(keys), protect_metrics="true")
    for path in ("/metrics", "/v1/metrics"):
        assert httpx.get(s.url + path).status_code == 401
        r = httpx.get(s.url + path, headers={"X-API-Key": KEY_A})
        assert r.status_code == 200 and "clipserve_requests_total" in r.text
    for path in (*PROBES, *NIM_PROBES):
        assert httpx.get(s.url + path).status_code == 200, path


# ---- 429 -------------------------------------------------------------------------------------


def test_openai_client_raises_rate_limit_error_and_a_name_shares_its_quota(
    server: RunningServer,
) -> None:
    name = model_name(server)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_B, max_retries=0) as c:
        assert len(c.embeddings.create(model=name, input=["a", "b"]).data) == 2  # the burst
    # team-b's other key: the same bucket, now empty (refused before the body is read).
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_B2, max_retries=0)
    with other as c, pytest.raises(openai.RateLimitError) as caught:
        c.embeddings.create(model=name, input="c")
    response = caught.value.response
    assert response.status_code == 429 and caught.value.code == "rate_limit_exceeded"
    assert 1 <= int(response.headers["retry-after"]) <= 100  # a token per 100 s
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert metric(server, 'clipserve_rate_limited_total{key="team-b"}') == 1


def test_every_item_counts_after_parsing(server: RunningServer) -> None:
    url, key = server.url + "/embed/text", {"X-API-Key": KEY_C}  # burst 3
    assert httpx.post(url, json=texts(2), headers=key).status_code == 200
    # One token left: enough to be read and parsed, not for two texts.
    r = httpx.post(url, json=texts(2), headers=key)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    # 100 s for the token it lacks, and 100 for the one it took, which its retry takes again.
    assert 199 <= int(r.headers["retry-after"]) <= 201
    assert "decode" in r.headers["server-timing"]  # it was parsed
    assert metric(server, 'clipserve_rate_limited_total{key="team-c"}') == 1
    assert httpx.post(url, json=texts(1), headers=key).status_code == 429  # nothing given back


def test_a_client_that_waits_as_told_is_served(server: RunningServer) -> None:
    url, key = server.url + "/embed/text", {"X-API-Key": KEY_E}  # 0.25 a second, burst 3
    assert httpx.post(url, json=texts(2), headers=key).status_code == 200
    refused = httpx.post(url, json=texts(2), headers=key)  # one token left: refused once parsed
    assert refused.status_code == 429
    time.sleep(int(refused.headers["retry-after"]))
    assert httpx.post(url, json=texts(2), headers=key).status_code == 200


def test_an_openai_request_of_images_alone_costs_a_token_an_image(server: RunningServer) -> None:
    # Its first place, taken as its body is read, is in the text tower, where it has nothing.
    images = [f"data:image/png;base64,{base64.b64encode(marked_png(i)).decode()}" for i in (1, 2)]
    name = model_name(server)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_F, max_retries=0) as c:
        assert len(c.embeddings.create(model=name, input=images).data) == 2  # burst 3
        assert len(c.embeddings.create(model=name, input=["the third"]).data) == 1


def test_an_empty_bucket_refuses_inference_only(server: RunningServer) -> None:
    key = {"X-API-Key": KEY_G}  # burst 1
    assert httpx.post(server.url + "/embed/text", json=texts(1), headers=key).status_code == 200
    index = httpx.post(server.url + "/v2/repository/index", headers=key)
    assert index.status_code == 200, index.text  # costs nothing, as over gRPC
    refused = httpx.post(server.url + "/embed/text", json=texts(1), headers=key)
    assert refused.status_code == 429


def test_triton_shape_for_429(server: RunningServer) -> None:
    url = f"{server.url}/v2/models/{model_name(server)}-text/infer"
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}
    headers = bearer(KEY_D)  # burst 1
    assert httpx.post(url, json=body, headers=headers).status_code == 200
    r = httpx.post(url, json=body, headers=headers)
    assert r.status_code == 429 and isinstance(r.json()["error"], str), r.text
    assert "team-d" in r.json()["error"] and 1 <= int(r.headers["retry-after"]) <= 100
    # Refused before the router, counted under its route all the same (not "other").
    assert metric(server, 'clipserve_requests_total{route="/v2/models/{name}/infer",status="429"}')


def test_without_keys_a_rate_limit_is_one_bucket_for_everyone(serve: Serve) -> None:
    s = serve(backend="fake", rate_limit="0.01:2")
    # A request larger than the burst passes on a full bucket, and leaves a debt.
    assert httpx.post(s.url + "/embed/text", json=texts(5)).status_code == 200
    r = httpx.post(s.url + "/embed", content=marked_png(3), headers=bearer("anything"))
    assert r.status_code == 429 and 300 < int(r.headers["retry-after"]) <= 400  # 4 tokens short
    assert metric(s, 'clipserve_rate_limited_total{key="anonymous"}') == 1  # no keys: open
    assert httpx.get(s.url + "/v1/models").status_code == 200  # GETs cost nothing


# ---- reloading -------------------------------------------------------------------------------


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_keys(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="clipserve.http.keys")
    keys = tmp_path / "keys.txt"
    keys.write_text(f"old:{KEY_A}\n")
    s = serve(backend="fake", api_keys=str(keys))

    def status(key: str) -> int:
        return httpx.get(s.url + "/info", headers={"X-API-Key": key}).status_code

    assert status(KEY_A) == 200 and status(KEY_B) == 401
    keys.write_text(f"new:{KEY_B}\n")
    until(lambda: status(KEY_B) == 200, what="the new key accepted")
    assert status(KEY_A) == 401
    keys.write_text(f"new:{KEY_B}\nbroken:key-12345678:fast\n")
    seen = "line 2: expected RATE or RATE:BURST (e.g. 50:100), got 'fast'; keeping the 1 keys"
    until(lambda: seen in caplog.text, what="the bad file seen")
    assert status(KEY_B) == 200
    # A key removed while another line is broken is revoked all the same: removals apply,
    # whatever else the file gets wrong (a typo must not keep a leaked key valid).
    keys.write_text(f"new:{KEY_B}\nother:{KEY_A}\n")
    until(lambda: status(KEY_A) == 200, what="both keys loaded")
    keys.write_text(f"new:{KEY_B}\nbroken:key-12345678:fast\n")  # KEY_A removed, line 2 bad
    until(lambda: status(KEY_A) == 401, what="the removed key revoked")
    assert status(KEY_B) == 200
    assert "keeping the 1 keys loaded before that it still names (1 dropped)" in caplog.text
    # Caught mid-write (empty, or a last line unfinished): nothing is revoked.
    for partial in ("", f"new:{KEY_B}\nother:sk-half-writ"):
        keys.write_text(partial)
        time.sleep(2.5)  # two reload checks
        assert status(KEY_B) == 200, partial


def test_sighup_reloads_a_file_whose_mtime_and_size_did_not_change(
    tiny_config: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"team:{KEY_A}\n")
    flags = ["--backend", "fake", "--model", str(tiny_config), "--pretrained", "none"]
    flags += ["--gpus", "cpu", "--api-keys", str(keys), "--log-level", "info"]
    with cli_server(flags, tmp_path / "server.log") as (proc, url):

        def status(key: str) -> int:
            return httpx.get(url + "/info", headers={"X-API-Key": key}).status_code

        assert status(KEY_A) == 200
        before = os.stat(keys)
        keys.write_text(f"team:{KEY_B}\n")  # the same length, in place: the same inode
        os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(keys)  # nothing a watcher could notice:
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        )
        proc.send_signal(signal.SIGHUP)
        until(lambda: status(KEY_B) == 200, what="the key file reloaded on SIGHUP")
        assert status(KEY_A) == 401 and proc.poll() is None


# ---- HTTPS -----------------------------------------------------------------------------------


def test_https_with_keys(tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    keys = tmp_path / "keys.txt"
    keys.write_text(f"team:{KEY_A}\n")
    config = make_config(
        tiny_config,
        tiny_checkpoint,
        backend="fake",
        api_keys=str(keys),
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
    )
    app = create_app(config, registry=CollectorRegistry())
    settings = build_uvicorn_config(
        app, config.http, host="127.0.0.1", port=free_port(), log_level="warning"
    )
    assert settings.ssl_certfile == str(cert)
    with uvicorn_thread(uvicorn.Server(settings)) as url:
        secure = url.replace("http://", "https://")
        trusted = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=secure, verify=trusted) as client:
            assert client.get("/readyz").status_code == 200
            r = client.post("/embed", content=marked_png(4), headers={**PNG, **bearer(KEY_A)})
            assert r.status_code == 200 and len(r.json()["embedding"]) == 32
            assert client.get("/info").status_code == 401
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(url + "/readyz", timeout=5)


def test_a_bad_certificate_is_a_startup_error(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate")
    config = make_config(
        tiny_config, tiny_checkpoint, ssl_certfile=str(cert), ssl_keyfile=str(cert)
    )
    with pytest.raises(StartupError, match="--ssl-certfile"):
        build_uvicorn_config(object(), config.http)
