"""Triton's system shared-memory extension end to end, over HTTP and gRPC, with the real
tritonclient and its `tritonclient.utils.shared_memory` (POSIX objects in /dev/shm): tensors
and embeddings cross no socket, and no client-made region can crash the server or reach
outside its object."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from clipserve.engine.slots import shm_dir
from clipserve.errors import PayloadTooLarge
from clipserve.http.asgi import RequestHead
from clipserve.http.doors.kserve import Infer
from clipserve.http.shm_regions import SharedMemoryRegions
from clipserve.protocol.shm import RegionRef
from tests.engine.test_workers_served import FRONT_ENDS, Server
from tests.helpers import (
    RunningServer,
    Serve,
    embed_image,
    free_port,
    metric,
    model_name,
    png_bytes,
    random_pixels,
    until,
)

EMBEDDING = 32 * 4  # the tiny model's FP32 embedding


@pytest.fixture
def server(serve: Serve) -> RunningServer:
    return serve(grpc_port=free_port(), shm_max_regions=4, shm_max_bytes=4 << 20)


@pytest.fixture
def regions() -> Iterator[list[Any]]:
    """Regions the test makes, destroyed at its end (even a failed one)."""
    made: list[Any] = []
    yield made
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _region(made: list[Any], name: str, size: int) -> Any:
    handle = shm.create_shared_memory_region(name, f"/{name}_{os.getpid()}", size)
    made.append(handle)
    return handle


def _clients(server: RunningServer) -> tuple[th.InferenceServerClient, tg.InferenceServerClient]:
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = tg.InferenceServerClient(f"127.0.0.1:{server.app.state.grpc_port}")
    return http, grpc


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_in_regions_equal_plain_inference(
    server: RunningServer, regions: list[Any], protocol: str
) -> None:
    http, grpc = _clients(server)
    client: Any = http if protocol == "http" else grpc
    lib: Any = th if protocol == "http" else tg
    name = model_name(server)
    pixels = np.stack([random_pixels(30), random_pixels(31)])
    pin = _region(regions, f"in_{protocol}", pixels.nbytes)
    pout = _region(regions, f"out_{protocol}", 2 * EMBEDDING + 64)
    shm.set_shared_memory_region(pin, [pixels])
    client.register_system_shared_memory(
        f"in_{protocol}", f"/in_{protocol}_{os.getpid()}", pixels.nbytes
    )
    client.register_system_shared_memory(
        f"out_{protocol}", f"/out_{protocol}_{os.getpid()}", 2 * EMBEDDING + 64
    )
    status = client.get_system_shared_memory_status(
        **({"as_json": True} if protocol == "grpc" else {})
    )
    listed = status if protocol == "http" else list(status["regions"].values())
    assert {r["name"] for r in listed} == {f"in_{protocol}", f"out_{protocol}"}

    inp = lib.InferInput("pixels", list(pixels.shape), "UINT8")
    inp.set_shared_memory(f"in_{protocol}", pixels.nbytes)
    out = lib.InferRequestedOutput("embedding")
    out.set_shared_memory(f"out_{protocol}", 2 * EMBEDDING + 64)
    result = client.infer(name + "-uint8", [inp], outputs=[out])
    answered = result.get_output("embedding")
    if protocol == "http":  # as Triton: neither data nor parameters
        assert set(answered) == {"name", "datatype", "shape"}
    else:
        assert answered.parameters["shared_memory_byte_size"].int64_param == 2 * EMBEDDING
    got = shm.get_contents_as_numpy(pout, np.float32, [2, 32])
    for i in range(2):
        np.testing.assert_allclose(got[i], embed_image(server, png_bytes(pixels[i])), atol=1e-5)

    client.unregister_system_shared_memory(f"in_{protocol}")
    with pytest.raises(InferenceServerException, match="not registered"):
        client.infer(name + "-uint8", [inp], outputs=[out])
    client.unregister_system_shared_memory()  # every region
    after = client.get_system_shared_memory_status(
        **({"as_json": True} if protocol == "grpc" else {})
    )
    assert not (after if protocol == "http" else after.get("regions"))
    http.close()
    grpc.close()


def test_refusals_are_client_errors_and_the_server_survives(
    server: RunningServer, regions: list[Any], tmp_path: Path
) -> None:
    http, grpc = _clients(server)
    name = model_name(server)
    pixels = random_pixels(40)[None]
    pin = _region(regions, "in", pixels.nbytes)
    shm.set_shared_memory_region(pin, [pixels])
    key = f"/in_{os.getpid()}"

    def refused(call: Any, code: str, text: str) -> None:
        with pytest.raises(InferenceServerException) as e:
            call()
        assert code in str(e.value.status()), e.value
        assert text in e.value.message(), e.value.message()

    # Past the object's end, our own files, a symlink, a name that is no key, CUDA.
    refused(
        lambda: http.register_system_shared_memory("r", key, pixels.nbytes, 1), "400", "exceeds"
    )
    refused(
        lambda: grpc.register_system_shared_memory("r", key, pixels.nbytes + 1),
        "INVALID_ARGUMENT",
        "exceeds",
    )
    own = Path("/dev/shm") / f"clipserve-{os.getpid()}-x.budget"  # as a slot or budget file
    own.write_bytes(bytes(64))
    try:
        refused(
            lambda: http.register_system_shared_memory("r", "/" + own.name, 8),
            "400",
            "not a client's",
        )
    finally:
        own.unlink()
    semaphore = Path("/dev/shm") / f"sem.mp-{os.getpid()}"  # as multiprocessing names them
    semaphore.write_bytes(bytes(64))
    try:
        refused(
            lambda: grpc.register_system_shared_memory("r", "/" + semaphore.name, 8),
            "INVALID_ARGUMENT",
            "not a client's",
        )
    finally:
        semaphore.unlink()
    link = Path("/dev/shm") / f"link_{os.getpid()}"
    link.symlink_to(f"/dev/shm/in_{os.getpid()}")
    try:
        refused(
            lambda: http.register_system_shared_memory("r", "/" + link.name, 8),
            "400",
            "cannot open",
        )
    finally:
        link.unlink()
    refused(
        lambda: http.register_system_shared_memory("r", "/../etc/passwd", 8),
        "400",
        "POSIX shared memory name",
    )
    refused(lambda: grpc.register_cuda_shared_memory("c", b"", 0, 8), "UNIMPLEMENTED", "CUDA")
    refused(lambda: http.register_cuda_shared_memory("c", b"", 0, 8), "400", "CUDA")

    http.register_system_shared_memory("in", key, pixels.nbytes)
    refused(
        lambda: grpc.register_system_shared_memory("in", key, 8),
        "INVALID_ARGUMENT",
        "already registered",
    )
    # Limits: 4 regions, 4 MiB in all.
    for i in range(3):
        http.register_system_shared_memory(f"more{i}", key, 8)
    refused(lambda: http.register_system_shared_memory("five", key, 8), "413", "--shm-max-regions")
    http.unregister_system_shared_memory()
    big = _region(regions, "big", 5 << 20)
    refused(
        lambda: grpc.register_system_shared_memory("big", f"/big_{os.getpid()}", 5 << 20),
        "RESOURCE_EXHAUSTED",
        "--shm-max-bytes",
    )
    del big

    http.register_system_shared_memory("in", key, pixels.nbytes)
    http.register_system_shared_memory("small", key, 16)
    inp = th.InferInput("pixels", list(pixels.shape), "UINT8")
    inp.set_shared_memory("in", pixels.nbytes, offset=8)  # runs past the region
    refused(lambda: http.infer(name, [inp]), "400", "exceeds region")
    inp = th.InferInput("pixels", list(pixels.shape), "UINT8")
    inp.set_shared_memory("in", pixels.nbytes)
    out = th.InferRequestedOutput("embedding")
    out.set_shared_memory("small", 16)  # smaller than the embedding
    computed = metric(server, "clipserve_items_total")
    refused(lambda: http.infer(name, [inp], outputs=[out]), "400", "cannot hold")
    gout = tg.InferRequestedOutput("embedding")
    gout.set_shared_memory("nowhere", 128)
    gin = tg.InferInput("pixels", list(pixels.shape), "UINT8")
    gin.set_shared_memory("in", pixels.nbytes)
    refused(lambda: grpc.infer(name, [gin], outputs=[gout]), "INVALID_ARGUMENT", "not registered")
    assert metric(server, "clipserve_items_total") == computed  # refused before any work
    # The client truncates its object after registering: a short read, a 400, no SIGBUS.
    os.truncate(f"/dev/shm/in_{os.getpid()}", 100)
    gin = tg.InferInput("pixels", list(pixels.shape), "UINT8")
    gin.set_shared_memory("in", pixels.nbytes)
    refused(lambda: grpc.infer(name, [gin]), "INVALID_ARGUMENT", "truncated")
    # Still serving.
    image = png_bytes(random_pixels(41))
    assert embed_image(server, image).shape == (32,)
    http.unregister_system_shared_memory()
    http.close()
    grpc.close()


def _infer(
    conn: HTTPConnection, model: str, inputs: list[Any], outputs: list[Any]
) -> tuple[int, Any]:
    """One KServe inference on this connection (so on the front end that holds it)."""
    body, json_size = th.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        return response.status, data
    length = response.getheader("Inference-Header-Content-Length")
    parsed = th.InferenceServerClient.parse_response_body(
        data, header_length=int(length) if length else None
    )
    return 200, parsed


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_with_workers_a_region_registered_on_one_front_end_serves_every_one(
    tiny_config: Path, tmp_path: Path, regions: list[Any]
) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "clipserve", "--workers", str(FRONT_ENDS), "--backend", "fake"]
    cmd += ["--model", str(tiny_config), "--pretrained", "none", "--gpus", "cpu"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0"]
    cmd += ["--shm-max-regions", "4"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    served = Server(proc, port, log)
    try:
        served.wait_ready()
        pixels = random_pixels(50)[None]
        pin = _region(regions, "in", pixels.nbytes)
        shm.set_shared_memory_region(pin, [pixels])
        outs = [_region(regions, f"out{i}", EMBEDDING) for i in range(FRONT_ENDS)]
        client = th.InferenceServerClient(f"127.0.0.1:{port}")  # one connection: one front end
        client.register_system_shared_memory("in", f"/in_{os.getpid()}", pixels.nbytes)
        for i in range(FRONT_ENDS):
            client.register_system_shared_memory(f"out{i}", f"/out{i}_{os.getpid()}", EMBEDDING)
        (model,) = [
            m["name"] for m in client.get_model_repository_index() if m["name"].endswith("-uint8")
        ]

        plain = th.InferInput("pixels", list(pixels.shape), "UINT8")
        plain.set_data_from_numpy(pixels)
        inp = th.InferInput("pixels", list(pixels.shape), "UINT8")
        inp.set_shared_memory("in", pixels.nbytes)
        held = served.spread(per_front_end=1)
        for i, (conn,) in enumerate(held.values()):
            status, expected = _infer(conn, model, [plain], [th.InferRequestedOutput("embedding")])
            assert status == 200, expected
            out = th.InferRequestedOutput("embedding")
            out.set_shared_memory(f"out{i}", EMBEDDING)
            status, answered = _infer(conn, model, [inp], [out])
            assert status == 200, answered
            got = shm.get_contents_as_numpy(outs[i], np.float32, [1, 32])
            np.testing.assert_array_equal(got, expected.as_numpy("embedding"))

        client.unregister_system_shared_memory()  # on one front end: gone on every one
        for conn in (c for cs in held.values() for c in cs):
            status, body = _infer(conn, model, [inp], [th.InferRequestedOutput("embedding")])
            assert status == 400 and b"not registered" in body, body
        client.close()
    finally:
        served.close_all()
        served.stop()
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert not list(shm_dir().glob(f"clipserve-{proc.pid}-*"))  # the table went with the slots


@pytest.fixture
def limited(serve: Serve) -> RunningServer:
    """Regions of up to 128 MiB, bodies of at most 1 MiB, a 1 s deadline."""
    return serve(
        grpc_port=free_port(),
        shm_max_regions=4,
        shm_max_bytes=128 << 20,
        max_body_bytes=1 << 20,
        request_timeout_s=1,
    )


def _shm_input(datatype: str, shape: list[int], byte_size: int) -> bytes:
    params = {"shared_memory_region": "big", "shared_memory_byte_size": byte_size}
    spec = {"name": "x", "datatype": datatype, "shape": shape, "parameters": params}
    return orjson.dumps({"inputs": [spec]})


def test_a_region_named_whole_is_refused_before_it_is_read(limited: RunningServer) -> None:
    """A client names its whole 64 MiB region (past --max-body-bytes) for one 150 KB image:
    refused from the shape (or the body limit, for BYTES) before the region is read. Its object
    is removed once registered, so any read would fail to open it: the answers say none ran."""
    http, grpc = _clients(limited)
    key = f"big_{os.getpid()}"
    path = Path("/dev/shm") / key
    with path.open("wb") as f:
        f.truncate(64 << 20)  # sparse: no memory
    try:
        http.register_system_shared_memory("big", "/" + key, 64 << 20)
    finally:
        path.unlink()
    name = model_name(limited)

    # The -uint8 model with a short header: the request once parsed on the event loop.
    header = _shm_input("UINT8", [1, 224, 224, 3], 64 << 20)
    answer = httpx.post(
        f"{limited.url}/v2/models/{name}-uint8/infer",
        content=header,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert answer.status_code == 400, answer.text
    assert "needs 150528 bytes; got 67108864" in answer.json()["error"]
    answer = httpx.post(
        f"{limited.url}/v2/models/{name}/infer", content=_shm_input("BYTES", [1], 64 << 20)
    )
    assert answer.status_code == 413, answer.text
    assert answer.json() == {
        "error": "shared_memory_byte_size 67108864 exceeds 1048576 bytes (--max-body-bytes)"
    }

    pixels = tg.InferInput("pixels", [1, 224, 224, 3], "UINT8")
    pixels.set_shared_memory("big", 64 << 20)
    with pytest.raises(InferenceServerException) as refused:
        grpc.infer(name + "-uint8", [pixels])
    assert "INVALID_ARGUMENT" in str(refused.value.status())
    assert "needs 150528 bytes; got 67108864" in refused.value.message()
    images = tg.InferInput("image", [1], "BYTES")
    images.set_shared_memory("big", 64 << 20)
    with pytest.raises(InferenceServerException) as refused:
        grpc.infer(name, [images])
    assert "RESOURCE_EXHAUSTED" in str(refused.value.status())
    assert "--max-body-bytes" in refused.value.message()
    http.close()
    grpc.close()


def test_a_read_past_its_cap_is_refused_before_the_object_is_opened() -> None:
    regions = SharedMemoryRegions(4, 1 << 20)
    key = f"cap_{os.getpid()}"
    path = Path("/dev/shm") / key
    path.write_bytes(bytes(range(256)) * 16)
    try:
        regions.register("r", "/" + key, 0, 4096)
        ref = RegionRef("r", 0, 4096)
        assert regions.read(ref, 4096) == path.read_bytes()
    finally:
        path.unlink()
    with pytest.raises(PayloadTooLarge, match="more than the 4095 it may hold"):
        regions.read(ref, 4095)


def _call(server: RunningServer, model: str, headers: dict[str, str]) -> Infer:
    """The HTTP door's call for an inference request with these headers (its body unread)."""

    async def receive() -> Any:
        raise AssertionError("the call is made before the body is read")

    scope = {
        "type": "http",
        "method": "POST",
        "path": f"/v2/models/{model}/infer",
        "path_params": {"name": model},
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "state": {"pipeline": server.state},
    }
    return Infer.of(RequestHead(scope, receive), server.state)


def test_only_binary_data_after_a_short_header_is_parsed_on_the_event_loop(
    server: RunningServer,
) -> None:
    """A body that is all header (an input in shared memory: a read of up to 64 crops) is
    parsed in the pool; only a view of binary data after a short header stays inline."""
    model = model_name(server) + "-uint8"
    ihcl = "Inference-Header-Content-Length"
    binary = {ihcl: "120", "Content-Length": str(120 + 224 * 224 * 3)}
    assert _call(server, model, binary).inline
    assert not _call(server, model, {ihcl: "120", "Content-Length": "120"}).inline  # shm
    assert not _call(server, model, {ihcl: "120", "Transfer-Encoding": "chunked"}).inline
    assert not _call(server, model, {ihcl: "5000", "Content-Length": "200000"}).inline
    assert not _call(server, model_name(server) + "-fp32", binary).inline


def _register(
    server: RunningServer, head: bytes, body: bytes
) -> tuple[socket.socket, HTTPResponse, Any]:
    """A raw register request (head lines, then `body`), its answer, and the socket (which
    times out after 5 s; closed when the test ends)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(b"POST /v2/systemsharedmemory/region/a/register HTTP/1.1\r\nHost: t\r\n")
    try:
        sock.sendall(head + b"\r\n" + body)
        response = HTTPResponse(sock)
        response.begin()
        return sock, response, json.loads(response.read())
    except BaseException:
        sock.close()
        raise


def _closed(sock: socket.socket) -> bool:
    """The server closed the connection once its answer was read (EOF or reset)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    ("deadline", "took"),
    [
        (b"", "1 s (--request-timeout-s)"),
        (b"X-Request-Timeout-Ms: 300\r\n", "0.3 s (X-Request-Timeout-Ms)"),
    ],
)
def test_a_register_body_that_stalls_gets_a_408_and_its_connection_closes(
    limited: RunningServer, deadline: bytes, took: str
) -> None:
    sock, response, error = _register(limited, deadline + b"Content-Length: 4000\r\n", b'{"key"')
    with sock:
        assert response.status == 408, error
        assert error["error"].startswith(f"request body not received within {took}"), error
        assert response.getheader("connection") == "close"
        assert _closed(sock)
    # A body declared past the register request's few bytes: refused at once.
    sock, response, error = _register(limited, b"Content-Length: 100000\r\n", b"")
    with sock:
        assert response.status == 413 and "a register request's most" in error["error"], error


def test_bytes_read_from_a_region_count_against_the_body_budget(
    serve: Serve, regions: list[Any]
) -> None:
    """A tensor read from shared memory is held in this process like a body: while one such
    request waits on the device, a second that would pass --max-body-bytes-in-flight gets the
    budget's 503; once the first is answered, the same request is served."""
    server = serve(
        backend="fake",
        backend_option=["latency_ms=1500"],
        grpc_port=free_port(),
        shm_max_regions=4,
        shm_max_bytes=4 << 20,
        max_body_bytes=200_000,
        max_body_bytes_in_flight=300_000,
    )
    image = 224 * 224 * 3
    handle = _region(regions, "pixels", 2 * image)
    shm.set_shared_memory_region(handle, [np.zeros(2 * image, np.uint8)])
    http, _ = _clients(server)
    http.register_system_shared_memory("pixels", f"/pixels_{os.getpid()}", 2 * image)
    url = f"{server.url}/v2/models/{model_name(server)}-uint8/infer"

    def infer(offset: int) -> httpx.Response:
        params = {
            "shared_memory_region": "pixels",
            "shared_memory_byte_size": image,
            "shared_memory_offset": offset,
        }
        spec = {"name": "x", "datatype": "UINT8", "shape": [1, 224, 224, 3], "parameters": params}
        return httpx.post(url, content=orjson.dumps({"inputs": [spec]}), timeout=30)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(infer, 0)
        budget = server.state.body_budget
        until(lambda: budget.used >= image, 10, "the first request's tensor held")
        refused = infer(image)  # 2 x 150528 + two headers > 300000
        assert first.result().status_code == 200
    assert refused.status_code == 503, refused.text
    assert "--max-body-bytes-in-flight" in refused.json()["error"]
    assert refused.headers["retry-after"]
    assert budget.used == 0  # both given back
    assert infer(image).status_code == 200
    http.close()


def test_shared_memory_is_off_by_default(serve: Serve, regions: list[Any]) -> None:
    """Registering trusts a client with the server's /dev/shm: off until the operator sets
    --shm-max-regions, on both protocols, and nothing is opened."""
    server = serve(grpc_port=free_port())
    http, grpc = _clients(server)
    _region(regions, "in", 64)
    key = f"/in_{os.getpid()}"
    for call, code in (
        (lambda: http.register_system_shared_memory("r", key, 8), "400"),
        (lambda: grpc.register_system_shared_memory("r", key, 8), "UNIMPLEMENTED"),
    ):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert code in str(e.value.status()), e.value
        assert "--shm-max-regions" in e.value.message(), e.value.message()
    assert not http.get_system_shared_memory_status()
    http.close()
    grpc.close()
