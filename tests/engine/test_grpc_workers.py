"""gRPC under `--workers N`: every front end serves Triton's service on the one --grpc-port (the
supervisor holds it with SO_REUSEPORT, each front end's grpc.aio server binds beside it), a
second server cannot take the port, SIGTERM lets the calls in flight finish, and a client
outlives a killed front end. Real processes, sockets, signals and tritonclient.grpc."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as tg
from PIL import Image
from tritonclient.utils import InferenceServerException

from clipserve.loadgen.procs import free_port
from tests.engine.test_shared_socket import Server, workers
from tests.helpers import until

# Multi-process servers started per test (~20 s each here): in `make test-slow`, which CI runs,
# so the default run stays near 10 minutes.
pytestmark = pytest.mark.slow

MODEL = "tiny-clip"  # the tiny config's file name


def _jpeg(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (shade, 80, 160)).save(out, "JPEG")
    return out.getvalue()


def _input(image: bytes) -> tg.InferInput:
    inp = tg.InferInput("image", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[image]], dtype=np.object_))
    return inp


def _client(port: int) -> tg.InferenceServerClient:
    # A channel of its own (not shared with the process's other channels to this target), so
    # each client is its own connection, as separate hosts would be.
    return tg.InferenceServerClient(
        f"127.0.0.1:{port}", channel_args=[("grpc.use_local_subchannel_pool", 1)]
    )


def _grpc_owners(server: Server, grpc_port: int) -> set[int]:
    """The supervisor's children with an established gRPC connection."""
    owners = set()
    for child in psutil.Process(server.proc.pid).children():
        try:
            for c in child.net_connections("tcp"):
                if c.laddr.port == grpc_port and c.raddr and c.status == "ESTABLISHED":
                    owners.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return owners


def test_every_front_end_serves_grpc_and_a_second_server_is_refused(
    tiny_config: Path, tmp_path: Path
) -> None:
    grpc_port = free_port()
    with workers(tiny_config, tmp_path, "--grpc-port", str(grpc_port)) as server:
        clients = [_client(grpc_port) for _ in range(16)]
        try:
            for i, client in enumerate(clients):
                got = client.infer(MODEL, [_input(_jpeg(i))]).as_numpy("embedding")
                assert got.shape[0] == 1 and np.isfinite(got).all()
            # 16 connections spread by the kernel's hash: all on one front end is 2 in 65536.
            assert len(_grpc_owners(server, grpc_port)) == 2
        finally:
            for client in clients:
                client.close()
        cmd = [sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"]
        cmd += ["--model", str(tiny_config), "--pretrained", "none", "--gpus", "cpu"]
        cmd += ["--host", "127.0.0.1", "--port", str(free_port()), "--grpc-port", str(grpc_port)]
        second = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert "--grpc-port" in second.stderr and str(grpc_port) in second.stderr
        assert server.proc.poll() is None


def test_sigterm_lets_grpc_calls_in_flight_finish(tiny_config: Path, tmp_path: Path) -> None:
    grpc_port = free_port()
    extra = ("--grpc-port", str(grpc_port), "--backend-option", "latency_ms=1500")
    with workers(tiny_config, tmp_path, *extra) as server:
        results: list[str] = []
        started = threading.Barrier(9)

        def call(i: int) -> None:
            client = _client(grpc_port)
            try:
                started.wait(30)
                client.infer(MODEL, [_input(_jpeg(i))], client_timeout=60)
                results.append("ok")
            except InferenceServerException as e:
                results.append(str(e.status()))
            finally:
                client.close()

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(30)
        until(lambda: len(_grpc_owners(server, grpc_port)) >= 1, 10, "calls in flight")
        os.kill(server.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert results == ["ok"] * 8
        assert server.proc.wait(60) == 0


def test_a_grpc_client_outlives_a_killed_front_end(tiny_config: Path, tmp_path: Path) -> None:
    grpc_port = free_port()
    with workers(tiny_config, tmp_path, "--grpc-port", str(grpc_port)) as server:
        client = _client(grpc_port)
        try:
            client.infer(MODEL, [_input(_jpeg(1))])
            owner = until(lambda: _grpc_owners(server, grpc_port), 10, "the client's front end")
            os.kill(next(iter(owner)), signal.SIGKILL)
            errors: list[str] = []

            def served() -> bool:
                try:
                    client.infer(MODEL, [_input(_jpeg(2))], client_timeout=10)
                    return True
                except InferenceServerException as e:  # UNAVAILABLE until it reconnects
                    errors.append(str(e.status()))
                    return False

            until(served, 60, "a call served after the kill", poll_s=0.2)
            assert set(errors) <= {"StatusCode.UNAVAILABLE"}, errors
        finally:
            client.close()


def test_a_shared_memory_region_registered_on_one_front_end_serves_on_all(
    tiny_config: Path, tmp_path: Path
) -> None:
    import tritonclient.utils.shared_memory as shm

    grpc_port = free_port()
    pixels = np.random.default_rng(0).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)
    key = f"/cs_test_{os.getpid()}"
    region = shm.create_shared_memory_region("in", key, pixels.nbytes)
    try:
        shm.set_shared_memory_region(region, [pixels])
        flags = ("--grpc-port", str(grpc_port), "--shm-max-regions", "4")
        with workers(tiny_config, tmp_path, *flags) as server:
            registrar = _client(grpc_port)
            registrar.register_system_shared_memory("in", key, pixels.nbytes)
            registrar.close()
            clients = [_client(grpc_port) for _ in range(16)]
            try:
                for client in clients:
                    inp = tg.InferInput("pixels", list(pixels.shape), "UINT8")
                    inp.set_shared_memory("in", pixels.nbytes)
                    got = client.infer(MODEL + "-uint8", [inp]).as_numpy("embedding")
                    assert got.shape == (1, 32)
                assert len(_grpc_owners(server, grpc_port)) == 2  # both front ends read it
                status = clients[0].get_system_shared_memory_status(as_json=True)
                assert list(status["regions"]) == ["in"]
                # Triton's statistics, summed over both front ends (and the engine's batches).
                stats = clients[0].get_inference_statistics(MODEL + "-uint8").model_stats[0]
                assert stats.inference_stats.success.count == 16
                assert stats.inference_count == 16
                assert sum(b.compute_infer.count for b in stats.batch_stats) >= 1
            finally:
                for client in clients:
                    client.close()
    finally:
        shm.destroy_shared_memory_region(region)
