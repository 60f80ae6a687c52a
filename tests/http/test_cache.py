"""The embedding cache end to end: real uvicorn (and --workers 2), real HTTP, the fake
executor; counts from the executor itself and from /metrics."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from clipserve.http.cache_keys import reads_cache
from clipserve.loadgen.procs import free_port
from tests.engine.test_workers_served import Server, request
from tests.helpers import PNG, RunningServer, Serve, marked_png, metric, post, until_async


def computed(server: RunningServer) -> int:
    return int(server.state.runtime.executors[0].items_run)


def counter(server: RunningServer, name: str, tower: str = "image") -> float:
    value = server.state.metrics.registry.get_sample_value(name, {"tower": tower})
    return float(value or 0.0)


def test_a_repeated_image_is_computed_once_and_answered_bit_for_bit(serve: Serve) -> None:
    server = serve(backend="fake", cache_mb=16)
    for name in ("hits", "misses", "merged"):  # at 0 before any: a sum of them is never empty
        assert metric(server, f'clipserve_cache_{name}_total{{tower="text"}}') == 0
    image = marked_png(11)
    first, second = post(server, image), post(server, image)
    assert first.status_code == second.status_code == 200
    assert first.content == second.content  # the cached answer is the computed one
    assert computed(server) == 1
    assert metric(server, 'clipserve_cache_misses_total{tower="image"}') == 1
    assert metric(server, 'clipserve_cache_hits_total{tower="image"}') == 1
    assert metric(server, "clipserve_cache_bytes") > 0
    # Normalisation is part of the key: the raw row is computed, not the normalised one reused.
    raw = post(server, image, path="/embed?normalize=false")
    assert raw.status_code == 200 and computed(server) == 2


def test_identical_requests_in_flight_are_merged(serve: Serve) -> None:
    server = serve(backend="fake", cache_mb=16, backend_option=["latency_ms=400"])
    image = marked_png(12)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            posts = [client.post("/embed", content=image, headers=PNG) for _ in range(4)]
            return await asyncio.gather(*posts)

    answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [200] * 4
    assert len({r.content for r in answers}) == 1
    assert computed(server) == 1
    assert counter(server, "clipserve_cache_merged_total") == 3


def test_no_cache_computes_again_and_stores(serve: Serve) -> None:
    server = serve(backend="fake", cache_mb=16)
    image = marked_png(13)
    assert post(server, image).status_code == 200
    fresh = post(server, image, {**PNG, "Cache-Control": "no-cache"})
    assert fresh.status_code == 200 and computed(server) == 2
    assert post(server, image).content == fresh.content
    assert computed(server) == 2
    assert counter(server, "clipserve_cache_hits_total") == 1
    # Header lines of one name make one list (RFC 9110 5.3): the second line's no-cache counts.
    lines = [("content-type", "image/png"), ("cache-control", "max-age=0")]
    lines.append(("cache-control", "no-cache"))
    again = httpx.post(f"{server.url}/embed", content=image, headers=lines, timeout=30)
    assert again.status_code == 200 and computed(server) == 3


@pytest.mark.parametrize(
    ("lines", "reads"),
    [
        ([], True),
        (["max-age=0"], True),
        (["max-age=0, No-Cache"], False),
        (["max-age=0", " no-cache "], False),
        (["no-cache-ish"], True),
    ],
)
def test_cache_control_lines_are_read_as_one_list(lines: list[str], reads: bool) -> None:
    assert reads_cache(lines) is reads


def test_a_failed_computation_is_not_cached(serve: Serve) -> None:
    server = serve(backend="fake", cache_mb=16, backend_option=["fail_pixel=7"])
    poisoned = marked_png(7)
    assert [post(server, poisoned).status_code for _ in range(2)] == [500, 500]
    assert server.state.runtime.executors[0].attempts == [1, 1]  # tried again each time
    assert counter(server, "clipserve_cache_hits_total") == 0


def test_a_client_gone_does_not_cancel_what_another_waits_for(serve: Serve) -> None:
    server = serve(backend="fake", cache_mb=16, backend_option=["latency_ms=400"], max_batch_size=1)
    batcher = server.state.towers["image"]
    cache = batcher.cache
    busy, shared = marked_png(14), marked_png(15)

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            holding = asyncio.create_task(client.post("/embed", content=busy, headers=PNG))
            await until_async(lambda: batcher.workers[0].in_flight == 1)
            leader = asyncio.create_task(client.post("/embed", content=shared, headers=PNG))
            await until_async(lambda: len(batcher.queue) == 1)  # queued behind `busy`
            follower = asyncio.create_task(client.post("/embed", content=shared, headers=PNG))
            await until_async(lambda: counter(server, "clipserve_cache_merged_total") == 1)
            leader.cancel()  # the connection closes: the server sees the client go
            await asyncio.gather(leader, return_exceptions=True)
            await until_async(lambda: [f.waiters for f in cache.flights.values()] == [1, 1])
            return await holding, await follower

    held, followed = asyncio.run(main())
    assert held.status_code == followed.status_code == 200
    assert computed(server) == 2  # busy, and the shared image once


def test_texts_are_cached_by_their_tokens(serve: Serve) -> None:
    server = serve(backend="fake", cache_mb=16)
    texts = {"texts": ["a photo of a cat", "a dog"]}
    first = httpx.post(server.url + "/embed/text", json=texts, timeout=30)
    # The tokenizer lowercases and folds spaces: the same tokens, the same entry.
    again = {"texts": ["A photo of a  cat", "a dog"]}
    second = httpx.post(server.url + "/embed/text", json=again, timeout=30)
    assert first.status_code == second.status_code == 200
    assert first.json()["embeddings"] == second.json()["embeddings"]
    assert sum(server.state.runtime.text_executors[0].attempts) == 2
    assert counter(server, "clipserve_cache_hits_total", "text") == 2


def test_a_tiny_cache_evicts_and_stays_within_its_budget(serve: Serve) -> None:
    # 1 MiB holds ~2,500 rows of the tiny model (32 floats + overhead): 60 requests of 64
    # texts (BPE merges some digit strings, so fewer distinct entries than texts).
    server = serve(backend="fake", cache_mb=1, max_items_per_request=64)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for r in range(60):
            texts = [f"text {r} {i}" for i in range(64)]
            assert client.post("/embed/text", json={"texts": texts}).status_code == 200
        assert metric(server, "clipserve_cache_evictions_total") > 0
        assert 0 < metric(server, "clipserve_cache_bytes") <= 1 << 20
        # The oldest are gone (computed again), the newest still cached.
        run = server.state.runtime.text_executors[0]
        before = sum(run.attempts)
        assert client.post("/embed/text", json={"texts": ["text 0 0"]}).status_code == 200
        assert client.post("/embed/text", json={"texts": ["text 59 63"]}).status_code == 200
        assert sum(run.attempts) == before + 1


@pytest.mark.slow  # a --workers 2 server of its own: ~15 s
def test_identical_items_from_two_front_ends_are_computed_once(
    tiny_config: Path, tmp_path: Path
) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"]
    cmd += ["--backend-option", "latency_ms=400", "--model", str(tiny_config)]
    cmd += ["--pretrained", "none", "--gpus", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, port, log)
    try:
        server.wait_ready()
        conns = [conns[0] for conns in server.spread(1).values()]  # one on each front end
        image = marked_png(16)
        with ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(lambda c: request(c, "POST", "/embed", image, "image/png"), conns)
            )
        assert [status for status, _, _ in answers] == [200, 200]
        assert answers[0][2] == answers[1][2]
        assert server.metric("clipserve_items_total") == 1
        assert server.metric("clipserve_cache_merged_total", 'tower="image"') == 1
        assert server.metric("clipserve_cache_misses_total", 'tower="image"') == 1
        assert server.metric("clipserve_cache_bytes") > 0
        # Now cached in the engine: a third request, on either front end, computes nothing.
        assert request(conns[0], "POST", "/embed", image, "image/png")[0] == 200
        assert server.metric("clipserve_cache_hits_total", 'tower="image"') == 1
        assert server.metric("clipserve_items_total") == 1
    finally:
        server.close_all()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_the_cache_works_behind_api_keys_and_a_hit_costs_no_item_token(
    serve: Serve, tmp_path: Path
) -> None:
    """Keys wrap each tower (rate limits charge where places are reserved): the cache must
    still be reached through them, and a cached image takes no place, so costs only the one
    place every request holds before its body is parsed."""
    keys = tmp_path / "keys.txt"
    keys.write_text("team:cache-key-0001:0.001:3\n")
    server = serve(backend="fake", cache_mb=16, api_keys=str(keys))
    headers = {**PNG, "Authorization": "Bearer cache-key-0001"}
    image = marked_png(21)
    answers = [post(server, image, headers) for _ in range(3)]  # 3 tokens: one per request
    assert [r.status_code for r in answers] == [200] * 3
    assert computed(server) == 1 and counter(server, "clipserve_cache_hits_total") == 2
    assert post(server, image, headers).status_code == 429
