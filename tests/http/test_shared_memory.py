"""Triton's system shared-memory extension end to end, over HTTP and gRPC, with the real
tritonclient and its `tritonclient.utils.shared_memory` (POSIX objects in /dev/shm): tensors
and embeddings cross no socket, and no client-made region can crash the server or reach
outside its object."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from clipserve.engine.slots import shm_dir
from tests.engine.test_workers_served import FRONT_ENDS, Server
from tests.helpers import (
    RunningServer,
    Serve,
    embed_image,
    free_port,
    model_name,
    png_bytes,
    random_pixels,
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
    refused(lambda: http.infer(name, [inp], outputs=[out]), "400", "cannot hold")
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


def test_with_workers_a_region_registered_on_one_front_end_serves_every_one(
    tiny_config: Path, tmp_path: Path, regions: list[Any]
) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "clipserve", "--workers", str(FRONT_ENDS), "--backend", "fake"]
    cmd += ["--model", str(tiny_config), "--pretrained", "none", "--gpus", "cpu"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0"]
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
