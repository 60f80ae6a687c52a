"""The fast lane (http/fastlane.py): inference POSTs skip Starlette's router and exception
middleware. It must pick the router's route, and answer as the router's path does: same
statuses, bodies, headers, metrics, request ids, access lines."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route

from clipserve.http.app import create_app
from clipserve.http.door import InferenceEndpoint
from clipserve.http.fastlane import FastLane, InferenceRoutes, first_match
from clipserve.http.request import ClientGone, DisconnectWatch, unless_gone
from tests.helpers import access_lines, make_config

TENSOR = {
    "content-type": "application/octet-stream",
    "x-tensor-dtype": "uint8",
    "x-tensor-shape": "1,224,224,3",
}


def pixels(seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, (1, 224, 224, 3), np.uint8).tobytes()


def kserve_body(seed: int = 0) -> tuple[bytes, dict[str, str]]:
    data = pixels(seed)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "pixels",
                    "datatype": "UINT8",
                    "shape": [1, 224, 224, 3],
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
    return header + data, headers


async def _nothing(app: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not the lane's request")


@pytest.fixture(scope="module")
def app(tiny_config: Path, tiny_checkpoint: Path) -> Starlette:
    config = make_config(tiny_config, tiny_checkpoint, backend="fake")
    return create_app(config, registry=CollectorRegistry())


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/embed"),
        ("GET", "/embed"),
        ("POST", "/embed/"),
        ("POST", "/embed/text"),
        ("POST", "/v1/embeddings"),
        ("POST", "/embeddings"),
        ("POST", "/v2/models/m/infer"),
        ("POST", "/v2/models/org/m/infer"),
        ("POST", "/v2/models/m/versions/1/infer"),
        ("POST", "/v2/models/org/m/versions/1/infer"),
        ("GET", "/v2/models/m/infer"),
        ("POST", "/v2/models/infer"),
        ("POST", "/v2/models/m/ready"),
        ("POST", "/v2/repository/index"),
        ("POST", "/healthz"),
        ("POST", "/nowhere"),
    ],
)
def test_the_lane_takes_exactly_the_routers_inference_routes(
    app: Starlette, method: str, path: str
) -> None:
    lane = FastLane(_nothing, InferenceRoutes(app.routes), {})
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    router = first_match(app.routes, scope)
    expected = (
        router[0]
        if router is not None
        and method == "POST"
        and isinstance(router[0], Route)
        and isinstance(router[0].app, InferenceEndpoint)
        else None
    )
    found = lane.routes.find(scope) if method == "POST" else None
    again = lane.routes.find(scope) if method == "POST" else None  # as kept for its path
    assert (again[0] if again else None) is (found[0] if found else None)
    assert (found[0] if found else None) is expected
    if found is not None and router is not None:
        assert found[1]["path_params"] == router[1]["path_params"]
    if method == "POST" and path in ("/embed", "/v2/models/org/m/versions/1/infer"):
        assert expected is not None  # the hot routes are the lane's


@pytest.mark.parametrize("path", ["/embed", "/v2/models/m/infer", "/healthz"])
def test_under_a_root_path_the_table_answers_as_the_router(app: Starlette, path: str) -> None:
    # uvicorn's path holds the prefix (root_path + path): the key check asks about these too.
    scope = {"type": "http", "method": "POST", "path": "/api" + path, "root_path": "/api"}
    router = first_match(app.routes, scope)
    inference = router is not None and isinstance(
        getattr(router[0], "app", None), InferenceEndpoint
    )
    assert (InferenceRoutes(app.routes).find(scope) is not None) is inference
    assert inference is (path != "/healthz")


@asynccontextmanager
async def served(app: Starlette) -> AsyncIterator[dict[str, Any]]:
    """The app's lifespan: its state, as uvicorn hands it to each request."""
    async with app.router.lifespan_context(app) as state:
        yield dict(state or {})


async def call(
    app: Starlette,
    state: dict[str, Any],
    path: str,
    body: bytes,
    headers: dict[str, str],
    *,
    general: bool = False,
    method: str = "POST",
) -> tuple[int, dict[str, str], bytes]:
    """One request as uvicorn makes it: through the fast lane, or (`general`) past it, under a
    root path the lane leaves to the router."""
    root = "/root" if general else ""
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": root + path,
        "raw_path": (root + path).encode(),
        "root_path": root,
        "query_string": query.encode(),
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "state": dict(state),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)  # connected until the answer
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    assert start["type"] == "http.response.start"
    answer = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], answer, b"".join(m.get("body", b"") for m in sent[1:])


CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("/embed", pixels(1), TENSOR),
    ("/embed?dtype=float16", pixels(1), TENSOR),
    ("/embed", pixels(1), {**TENSOR, "accept": "application/msgpack"}),
    ("/embed", pixels(1)[:-1], TENSOR),  # 400 invalid tensor
    ("/embed", pixels(1), {**TENSOR, "x-tensor-dtype": "float64"}),
    ("/embed", pixels(1), {**TENSOR, "content-type": "text/plain"}),  # 415
    ("/embed", pixels(1), {**TENSOR, "accept": "image/gif"}),  # 406
    ("/embed?normalize=maybe", pixels(1), TENSOR),  # 422
    ("/embed", pixels(1), {**TENSOR, "x-request-timeout-ms": "soon"}),  # 400
    ("/embed", pixels(1), {**TENSOR, "x-request-id": "bad id"}),  # 400, the observer's
    ("/embed", pixels(1), {**TENSOR, "content-length": str(10**12)}),  # 413
    ("/embed/text", b'{"texts": ["a cat"]}', {"content-type": "application/json"}),
]


def _same_shape(a: dict[str, str], b: dict[str, str]) -> None:
    """Same header names and values, but for the request id and the times."""
    assert a.keys() == b.keys()
    for name in a.keys() - {"x-request-id", "server-timing"}:
        assert a[name] == b[name], name
    stages = [re.findall(r"(\w+);dur=", h["server-timing"]) for h in (a, b)]
    assert stages[0] == stages[1]


def test_the_lane_answers_as_the_router_does(app: Starlette) -> None:
    async def both() -> list[tuple[Any, Any]]:
        async with served(app) as state:
            out = []
            for path, body, headers in CASES:
                fast = await call(app, state, path, body, headers)
                general = await call(app, state, path, body, headers, general=True)
                out.append((fast, general))
            return out

    statuses = []
    for (path, _, _), (fast, general) in zip(CASES, asyncio.run(both()), strict=True):
        assert fast[0] == general[0], path
        _same_shape(fast[1], general[1])
        assert fast[2] == general[2], path
        statuses.append(fast[0])
    assert statuses == [200, 200, 200, 400, 400, 415, 406, 422, 400, 400, 413, 200]


def test_kserve_answers_the_same_either_way_and_in_tritons_shape(app: Starlette) -> None:
    body, headers = kserve_body(2)

    async def run() -> list[tuple[int, dict[str, str], bytes]]:
        async with served(app) as state:
            name = state["pipeline"].names.image[0]
            return [
                await call(app, state, f"/v2/models/{name}-uint8/infer", body, headers),
                await call(
                    app, state, f"/v2/models/{name}-uint8/infer", body, headers, general=True
                ),
                await call(app, state, f"/v2/models/{name}/versions/1/infer", body, headers),
                await call(app, state, "/v2/models/nope/infer", body, headers),
            ]

    uint8, general, versioned, unknown = asyncio.run(run())
    assert uint8[0] == general[0] == versioned[0] == 200
    assert uint8[2] == general[2]
    assert json.loads(uint8[2])["outputs"][0]["shape"] == [1, 32]
    assert unknown[0] == 404 and set(json.loads(unknown[2])) == {"error"}  # Triton's shape


def test_request_ids_metrics_and_access_lines_on_the_fast_path(app: Starlette) -> None:
    async def run() -> tuple[int, dict[str, str], bytes]:
        async with served(app) as state:
            return await call(app, state, "/embed", pixels(3), {**TENSOR, "x-request-id": "r-1"})

    with access_lines() as lines:
        status, headers, _ = asyncio.run(run())
    assert status == 200 and headers["x-request-id"] == "r-1"
    stages = re.findall(r"(\w+);dur=", headers["server-timing"])
    assert stages == ["receive", "decode", "queue", "compute", "encode", "total"]
    fields = [f for r in lines if (f := getattr(r, "fields", {})).get("request_id") == "r-1"]
    assert len(fields) == 1
    assert fields[0]["route"] == "/embed" and fields[0]["status"] == 200
    assert fields[0]["items"] == 1
    text = app.state.pipeline.metrics.render().decode()
    assert re.search(r'clipserve_requests_total\{route="/embed",status="200"\} [1-9]', text)
    assert re.search(
        r'clipserve_stage_duration_seconds_count\{protocol="raw-tensor",stage="queue"\}', text
    )


# ---- unless_gone: one watcher task, the work in the caller's --------------------------------


async def _gone_after(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def _until_cancelled(cancelled: asyncio.Event) -> int:
    """Work that only ends by cancellation, which it records."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return 1


def test_a_client_gone_first_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def run() -> None:
        with pytest.raises(ClientGone):
            await unless_gone(lambda: _gone_after(0.01), _until_cancelled(cancelled))
        assert cancelled.is_set()
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # our cancellation taken back
        await asyncio.sleep(0)  # and none left pending on the task

    asyncio.run(run())


def test_work_done_first_is_the_answer_and_the_watch_ends() -> None:
    watching: list[asyncio.Task[Any]] = []

    async def never() -> None:
        task = asyncio.current_task()
        assert task is not None
        watching.append(task)
        await asyncio.sleep(3600)

    async def run() -> int:
        answer = await unless_gone(never, asyncio.sleep(0.01, result=7))
        await asyncio.sleep(0)
        assert watching[0].cancelled()
        return answer

    assert asyncio.run(run()) == 7


def test_a_deadline_is_not_a_client_gone() -> None:
    async def run() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await unless_gone(lambda: _gone_after(10), asyncio.sleep(10))

    asyncio.run(run())


def test_work_that_swallows_the_cancellation_still_reports_the_client_gone() -> None:
    async def stubborn() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return 3  # cleans up and returns, as a careless awaitable might
        return 0

    async def run() -> None:
        with pytest.raises(ClientGone):
            await unless_gone(lambda: _gone_after(0.01), stubborn())
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    asyncio.run(run())


# ---- unless_gone on the connection's watch: no task, the protocol's callback cancels --------


async def _never() -> None:
    raise AssertionError("with a watch, no watcher awaits gone()")


def test_a_connection_lost_cancels_the_work_through_its_watch() -> None:
    cancelled = asyncio.Event()
    watch = DisconnectWatch()

    async def run() -> None:
        tasks_before = len(asyncio.all_tasks())
        asyncio.get_running_loop().call_later(0.01, watch.lost)  # as connection_lost calls it
        waiting = asyncio.ensure_future(unless_gone(_never, _until_cancelled(cancelled), watch))
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == tasks_before + 1  # the waiting one only: no watcher
        with pytest.raises(ClientGone):
            await waiting
        assert cancelled.is_set()
        assert waiting.cancelling() == 0  # our cancellation taken back
        assert watch.callbacks == []

    asyncio.run(run())


def test_the_wait_resumes_reading_so_that_a_close_is_heard() -> None:
    """uvicorn stops reading while a body past 64 KiB waits to be taken (on_body pauses, the
    app's receive() resumes); after the last chunk nobody calls receive(), so the wait itself
    must resume it, or the socket's close goes unread and the request stays queued."""
    watch = DisconnectWatch()
    resumed: list[bool] = []
    watch.listen = lambda: resumed.append(True)

    async def run() -> int:
        return await unless_gone(_never, asyncio.sleep(0, result=1), watch)

    assert asyncio.run(run()) == 1 and resumed == [True]


def test_work_done_first_leaves_the_watch_free_for_the_next_request() -> None:
    watch = DisconnectWatch()

    async def run() -> list[int]:
        answers = [await unless_gone(_never, asyncio.sleep(0.001, result=n), watch) for n in (1, 2)]
        assert watch.callbacks == []
        watch.lost()  # after the answers: nobody is cancelled
        await asyncio.sleep(0)
        return answers

    assert asyncio.run(run()) == [1, 2]


def test_a_connection_gone_before_the_wait_starts_no_work() -> None:
    watch = DisconnectWatch()
    watch.lost()
    started: list[int] = []

    async def work() -> int:
        started.append(1)
        return 1

    async def run() -> None:
        with pytest.raises(ClientGone):
            await unless_gone(_never, work(), watch)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    asyncio.run(run())  # warnings are errors: an unawaited coroutine would fail here
    assert started == []


def test_a_deadline_with_a_watch_is_not_a_client_gone() -> None:
    watch = DisconnectWatch()

    async def run() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await unless_gone(_never, asyncio.sleep(10), watch)
        assert watch.callbacks == []

    asyncio.run(run())


def test_work_that_swallows_the_cancellation_still_reports_a_lost_connection() -> None:
    watch = DisconnectWatch()

    async def stubborn() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return 3
        return 0

    async def run() -> None:
        asyncio.get_running_loop().call_later(0.01, watch.lost)
        with pytest.raises(ClientGone):
            await unless_gone(_never, stubborn(), watch)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    asyncio.run(run())


def test_two_waits_on_one_connection_are_both_cancelled() -> None:
    watch = DisconnectWatch()  # a request waiting on both towers: two tasks, one connection

    async def run() -> list[bool]:
        first = asyncio.ensure_future(unless_gone(_never, asyncio.sleep(10), watch))
        second = asyncio.ensure_future(unless_gone(_never, asyncio.sleep(10), watch))
        await asyncio.sleep(0)
        watch.lost()
        done = await asyncio.gather(first, second, return_exceptions=True)
        return [isinstance(d, ClientGone) for d in done]

    assert asyncio.run(run()) == [True, True]


def test_one_wait_ending_leaves_the_other_watched() -> None:
    watch = DisconnectWatch()

    async def run() -> None:
        short = asyncio.ensure_future(unless_gone(_never, asyncio.sleep(0.001, result=1), watch))
        long = asyncio.ensure_future(unless_gone(_never, asyncio.sleep(10), watch))
        assert await short == 1
        watch.lost()
        with pytest.raises(ClientGone):
            await long

    asyncio.run(run())
