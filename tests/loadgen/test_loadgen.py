"""The load generator (clipserve.loadgen) against real servers: counts, percentiles, windows,
coordinated omission, and targets that refuse, fail or stall."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn

from clipserve.loadgen.images import SourceImage, synthetic_image
from clipserve.loadgen.loadgen import LoadSpec, run_async, run_load
from clipserve.loadgen.output import details
from clipserve.loadgen.payloads import ModelInput, Request, build_requests
from clipserve.loadgen.procs import free_port, server_command
from clipserve.loadgen.runner import run_point
from clipserve.loadgen.server import fetch_info, parse_metrics
from clipserve.loadgen.stats import Latencies
from tests.helpers import Serve, png_bytes, random_pixels, uvicorn_thread

PNG = Request("/embed", png_bytes(random_pixels(0)), {"Content-Type": "image/png"}, 1)


def _metrics(url: str) -> dict[Any, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as r:
        return parse_metrics(r.read().decode())


def _served(before: dict[Any, float], after: dict[Any, float], route: str, status: str) -> float:
    key = ("clipserve_requests_total", (("route", route), ("status", status)))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_hdr_percentiles_agree_with_numpy() -> None:
    rng = np.random.default_rng(0)
    seconds = rng.lognormal(mean=-4, sigma=1.0, size=20_000)  # ~18 ms median, long tail
    lat = Latencies()
    for s in seconds:
        lat.record(float(s))
    got = lat.summary()
    for p in (50, 90, 99, 99.9):
        want = float(np.percentile(seconds * 1000, p))
        assert got[f"p{p:g}"] == pytest.approx(want, rel=2e-3, abs=0.002)  # 3 digits of HDR
    assert got["max"] == pytest.approx(seconds.max() * 1000, rel=1e-3)
    merged = Latencies(lat.encode())  # what --procs sends between processes
    merged.merge(lat)
    assert merged.count == 40_000 and merged.percentile_ms(99) == lat.percentile_ms(99)


def test_counts_and_percentiles_match_the_server(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=5"], max_batch_size=8)
    before = _metrics(server.url)
    spec = LoadSpec(concurrency=4, requests=60, warmup_s=0, keep_raw=True)
    result = run_point(server.url, [PNG], spec)
    after = _metrics(server.url)
    assert result.ok == result.completed == 60 and result.unfinished == 0
    assert _served(before, after, "/embed", "200") == 60  # the server's own counter
    assert result.server is not None and result.server["images"] == 60
    assert result.server["requests_by_status"] == {"/embed 200": 60}
    assert result.server["mean_batch_size"] > 1  # 4 clients share forward passes
    assert set(result.server["stage_ms"]) == {"receive", "decode", "queue", "compute", "encode"}
    assert result.server["stage_ms"]["compute"] >= 5  # the simulated device time
    assert set(result.server["stage_ms"]) <= set(result.server_timing_ms)
    # Percentiles against numpy on the raw latencies of the same run.
    tally = run_async(run_load(server.url, [PNG], spec))
    raw = np.sort(np.array(tally.raw or []) * 1000)
    assert len(raw) == 60
    for p in (50, 90, 99):  # HdrHistogram's rank: the value at round(p% of n)
        want = raw[max(1, int(p / 100 * len(raw) + 0.5)) - 1]
        assert tally.latency.percentile_ms(p) == pytest.approx(want, rel=2e-3, abs=0.002)
    assert tally.latency.summary()["max"] == pytest.approx(raw[-1], rel=2e-3)


def test_every_payload_kind_is_served(serve: Serve) -> None:
    """Every payload, under the names a migrated deployment serves (read from /info)."""
    names = {"served_model_name": ["org/clip"], "output_name": "OUTPUT__0"}
    server = serve(backend="fake", max_items_per_request=8, **names)
    info = run_async(fetch_info(server.url))
    assert info is not None and info["model_name"] == "tiny-clip"
    sources = [SourceImage(synthetic_image(320, 240, seed)) for seed in range(6)]
    from clipserve.loadgen.payloads import KINDS

    for name, kind in KINDS.items():
        n = 1 if kind.single else 3
        for dtype in ("uint8", "float16") if "tensor" in name else ("uint8",):
            reqs = build_requests(
                name, sources, ModelInput.from_info(info), images_per_request=n, tensor_dtype=dtype
            )
            tally = run_async(run_load(server.url, reqs, LoadSpec(concurrency=2, requests=4)))
            assert tally.statuses == {"200": 4}, (name, dtype, tally.error_samples)
            assert tally.items_ok == 4 * n


def test_open_loop_rate_and_window_hold(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=2"])
    spec = LoadSpec(rate=80, arrivals="constant", duration_s=1.5, warmup_s=0.5)
    t0 = time.perf_counter()
    result = run_point(server.url, [PNG], spec)
    elapsed = time.perf_counter() - t0
    assert 110 <= result.completed + result.unfinished <= 125  # 80/s for 1.5 s, constant
    assert result.ok == result.completed and elapsed < 2.0 + 1.5  # no wait past the window
    assert result.send_lag_ms["p50"] < 5 and result.window_s == pytest.approx(1.5, abs=0.05)


def test_throughput_counts_answers_that_arrive_in_the_window(serve: Serve) -> None:
    """400 ms per request, one client, window [0.5, 1.5) s: answers arrive at ~0.8 and ~1.2 s,
    so 2 requests/s, although only the second was sent inside the window."""
    server = serve(backend="fake", backend_option=["latency_ms=400"])
    result = run_point(server.url, [PNG], LoadSpec(concurrency=1, duration_s=1.0, warmup_s=0.5))
    assert result.requests_per_s == pytest.approx(2, abs=0.1)
    assert result.completed == 1 and result.latency_ms["max"] >= 400


class Stalling:
    """An ASGI app that answers at once, except that requests arriving during the stall window
    wait until its end: the server stops for `length` seconds. Other paths: 404."""

    def __init__(self) -> None:
        self.window = (float("inf"), float("inf"))

    def stall(self, after: float, length: float) -> None:
        now = time.perf_counter()
        self.window = (now + after, now + after + length)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] != "/":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        arrived = time.perf_counter()
        # A sleep, polled rather than an Event: this server's stall is the behaviour under test,
        # and the test releases everyone by moving the window.
        while self.window[0] <= arrived < self.window[1] > time.perf_counter():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        status = 200
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"error": "no"}'})


@contextlib.contextmanager
def asgi_server(app: Any) -> Iterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", lifespan="off")
    )
    with uvicorn_thread(server) as url:
        yield url


def test_open_loop_shows_a_stall_that_closed_loop_hides() -> None:
    """Coordinated omission: a 1 s stall in a 3 s run. The closed-loop client waits politely
    and records one slow request; the open-loop one charges every request the stall delayed."""
    app = Stalling()
    get = [Request("/", b"", {}, 1, method="GET")]
    with asgi_server(app) as url:
        app.stall(after=1.0, length=1.0)
        # Four connections: during the stall later requests wait for one inside the client,
        # and that wait is charged too (latency counts from the intended send time).
        spec = LoadSpec(rate=100, duration_s=3, connections=4, seed=1)
        opened = run_async(run_load(url, get, spec))
        app.stall(after=1.0, length=1.0)
        closed = run_async(run_load(url, get, LoadSpec(concurrency=1, duration_s=3)))
    # ~100 of ~300 open-loop requests were due during the stall, waiting 0-1000 ms.
    assert opened.latency.percentile_ms(90) > 300 and opened.latency.percentile_ms(99) > 800
    assert closed.latency.percentile_ms(99) < 50 < 900 < closed.latency.summary()["max"]


def test_a_server_that_never_answers_is_reported_on_time() -> None:
    app = Stalling()
    get = [Request("/", b"", {}, 1, method="GET")]
    with asgi_server(app) as url:
        app.stall(after=0.0, length=30.0)
        t0 = time.perf_counter()
        result = run_point(url, get, LoadSpec(rate=50, duration_s=1.5, warmup_s=0))
        elapsed = time.perf_counter() - t0
        app.window = (0.0, 0.0)  # let the server's pending handlers go
    assert elapsed < 4  # the window holds: nothing is waited on past it
    assert result.completed == 0 and 50 <= result.unfinished <= 110
    assert result.latency_ms["max"] >= 1300  # the oldest, counted at its age at the end
    assert any("still in flight" in w for w in result.warnings)


def test_refused_connections_and_error_storms_are_reported(serve: Serve) -> None:
    spec = LoadSpec(concurrency=4, requests=20)
    refused = run_point(f"http://127.0.0.1:{free_port()}", [PNG], spec)
    assert refused.ok == 0 and refused.statuses == {"ClientConnectorError": 20}
    assert "Connect" in refused.error_samples["ClientConnectorError"] and refused.server is None
    assert any("20 of 20 requests failed" in w for w in refused.warnings)

    server = serve(backend="fake", backend_option=["fail_pixel=7"])
    bad = Request("/embed", b"not an image", {"Content-Type": "image/jpeg"}, 1)
    crop = np.full((1, 224, 224, 3), 7, np.uint8)  # the fake fails batches holding pixel 7
    fails = Request(
        "/embed",
        crop.tobytes(),
        {
            "Content-Type": "application/octet-stream",
            "X-Tensor-Dtype": "uint8",
            "X-Tensor-Shape": "1,224,224,3",
        },
        1,
    )
    result = run_point(server.url, [bad, fails, PNG], LoadSpec(concurrency=3, requests=30))
    assert result.statuses == {"400": 10, "500": 10, "200": 10}
    assert "invalid_image" in result.error_samples["400"]
    assert result.server is not None
    assert result.server["requests_by_status"] == {
        "/embed 400": 10,
        "/embed 500": 10,
        "/embed 200": 10,
    }


def test_client_processes_merge(serve: Serve) -> None:
    server = serve(backend="fake")
    before = _metrics(server.url)
    result = run_point(server.url, [PNG], LoadSpec(concurrency=4, requests=41), procs=2)
    after = _metrics(server.url)
    assert result.ok == 41 == _served(before, after, "/embed", "200")
    assert len(result.client_cpu) == 2 and result.latency_ms["p50"] > 0


def test_cli_sweeps_and_writes_table_json_csv_and_plot(
    serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipserve.loadgen.cli import main

    server = serve(backend="fake")
    out = tmp_path / "r"
    argv = [
        "--url",
        server.url,
        "-c",
        "1,3",
        "-n",
        "12",
        "--warmup",
        "0",
        "--payload",
        "msgpack-images",
        "-b",
        "2",
        "--image-size",
        "64x48",
        "--usd-per-hour",
        "2.5",
        "--json",
        f"{out}.json",
        "--csv",
        f"{out}.csv",
        "--plot",
        f"{out}.png",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "msgpack-images x 2" in printed.out and "$/M img" in printed.out
    assert "c=1" in printed.err  # the live progress line
    doc = json.loads(Path(f"{out}.json").read_text())
    first, second = doc["results"]
    assert [first["load"], second["load"]] == ["c=1", "c=3"] and second["ok"] == 12
    assert second["images_per_s"] == pytest.approx(2 * second["requests_per_s"], rel=1e-3)
    cost = 2.5 / (second["images_per_s"] * 3600) * 1e6
    assert second["usd_per_million_images"] == pytest.approx(cost, rel=1e-3)
    assert Latencies(second["latency_hist"]).count == 12  # the histogram itself, re-readable
    rows = Path(f"{out}.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("mode,load,req/s")
    assert Path(f"{out}.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["--url", server.url, "--payload", "jpeg", "-b", "4", "-n", "1"]) == 2  # refused


def test_the_cli_measures_the_model_not_the_cache_unless_asked(
    serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    """It sends a few images over and over: each request says Cache-Control: no-cache, so an
    embedding cache answers none of them (--use-cache lets it)."""
    from clipserve.loadgen.cli import main

    server = serve(backend="fake", cache_mb="16")
    argv = ["--url", server.url, "-c", "1", "-n", "16", "--warmup", "0", "--image-size", "64x48"]

    def hits() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith('clipserve_cache_hits_total{tower="image"}')
        )

    assert main(argv) == 0
    assert hits() == 0
    assert main([*argv, "--use-cache"]) == 0
    assert hits() >= 8  # 16 requests of 8 distinct images
    capsys.readouterr()


def test_benchmark_servers_keep_off_tritons_grpc_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's server serves gRPC on a free port of its own, not 8001 (which a test's or
    another benchmark's server may hold); a flag or the environment's choice stands."""
    monkeypatch.delenv("CLIPSERVE_GRPC_PORT", raising=False)
    cmd = server_command(["--backend", "fake"], 18000)
    grpc = int(cmd[cmd.index("--grpc-port") + 1])
    assert grpc not in (8001, 18000) and cmd.count("--grpc-port") == 1
    assert server_command(["--grpc-port", "9"], 18000).count("--grpc-port") == 1
    monkeypatch.setenv("CLIPSERVE_GRPC_PORT", "0")
    assert "--grpc-port" not in server_command(["--backend", "fake"], 18000)


def test_percentiles_are_of_ok_answers_and_errors_have_their_own(serve: Serve) -> None:
    """Fast refusals beside slow successes: the percentiles are the successes' alone."""
    server = serve(backend="fake", backend_option=["latency_ms=300"])
    bad = Request("/embed", b"not an image", {"Content-Type": "image/jpeg"}, 1)
    result = run_point(server.url, [bad, PNG], LoadSpec(concurrency=2, requests=10))
    assert result.statuses == {"400": 5, "200": 5}
    assert Latencies(result.latency_hist).count == 5
    assert result.latency_ms["p50"] >= 300  # the OK answers' simulated compute
    assert result.error_latency_ms["max"] < 300 <= result.latency_ms["max"]
    assert "error answers took" in details(result)


def test_server_counts_cover_the_measured_window_not_the_warmup(serve: Serve) -> None:
    """The server's "before" is scraped when the window opens, so its requests match the
    client's: within those answered while it is read, not the warm-up's ~2 s of answers."""
    server = serve(backend="fake", backend_option=["latency_ms=20"])
    spec = LoadSpec(concurrency=2, duration_s=1.0, warmup_s=2.0)
    result = run_point(server.url, [PNG], spec)
    assert result.server is not None and result.ok > 10
    answered = round(result.requests_per_s * result.window_s)  # OK answers in the window
    # Off by what completes while the window's scrape is under way (more on a loaded
    # machine); the warm-up's answers (~160 here, when they were counted) are far more.
    assert abs(result.server["requests_by_status"]["/embed 200"] - answered) <= max(
        5, answered // 4
    )


def test_server_stage_means_are_per_request_and_per_request_reaching_it(serve: Serve) -> None:
    """Cache hits skip queue and compute: one computation among 10 requests. Per request, as
    Server-Timing's means; per request that reached the stage, labelled so."""
    server = serve(backend="fake", backend_option=["latency_ms=50"], cache_mb=16)
    result = run_point(server.url, [PNG], LoadSpec(concurrency=1, requests=10))
    assert result.server is not None and result.ok == 10
    stages, reached = result.server["stage_ms"], result.server["stage_ms_reached"]
    assert result.server["stage_requests"]["compute"] == 1
    assert result.server["stage_requests"]["receive"] == 10
    assert reached["compute"] >= 50
    assert stages["compute"] == pytest.approx(reached["compute"] / 10, rel=1e-3, abs=1e-3)
    assert stages["compute"] == pytest.approx(result.server_timing_ms["compute"], rel=0.05)
    assert "per request that reached the stage: " in details(result)
