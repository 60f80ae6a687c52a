"""Tensor requests per core over gRPC vs HTTP (KServe v2 / Triton), and what system shared
memory saves.

One `clipserve` process pinned to one core (fake backend, `compute=0`: the device costs
nothing, so the server's CPU per request is the protocol's), the load from this process on the
other core. Each request is one UINT8 [1, 224, 224, 3] tensor (147 KiB) and asks for the FP32
embedding. Variants, in interleaved rounds with the order rotated:

- `http`: Triton's binary tensor extension over HTTP/1.1 keep-alive (aiohttp);
- `grpc`: ModelInfer with `raw_input_contents` over one HTTP/2 channel (grpc.aio);
- `http-shm`, `grpc-shm`: the same with the tensor and the output in registered system
  shared-memory regions (only a region's name and offset on the wire).

Reported per variant: requests per second, and the server's CPU time per request (its process
CPU seconds over the requests answered: the number that says how many cores a load needs).

    python -m bench.grpc_vs_http --out bench/results/grpc-vs-http.json   # 5 rounds of 5 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import psutil
from tritonclient.grpc import service_pb2 as pb

from bench.common import machine, rotated, spread, utc_now, write_report
from clipserve.loadgen.procs import clipserve_process, free_port, tiny_model
from clipserve.protocol import kserve

VARIANTS = ("http", "grpc", "http-shm", "grpc-shm")
CONCURRENCY = 16
MODEL = "tiny-clip"
SHAPE = (1, 224, 224, 3)
METHOD = "/inference.GRPCInferenceService/ModelInfer"


def _grpc_request(tensor: np.ndarray, shm: bool) -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    inp = request.inputs.add(name="pixels", datatype="UINT8", shape=list(tensor.shape))
    out = request.outputs.add(name="embedding")
    if shm:
        inp.parameters["shared_memory_region"].string_param = "bench_in"
        inp.parameters["shared_memory_byte_size"].int64_param = tensor.nbytes
        out.parameters["shared_memory_region"].string_param = "bench_out"
        out.parameters["shared_memory_byte_size"].int64_param = 4096
    else:
        request.raw_input_contents.append(tensor.tobytes())
    return request.SerializeToString()


def _http_request(tensor: np.ndarray, shm: bool) -> tuple[bytes, dict[str, str]]:
    if not shm:
        return kserve.build_infer_request(tensor=tensor)
    doc = {
        "inputs": [
            {
                "name": "pixels",
                "datatype": "UINT8",
                "shape": list(tensor.shape),
                "parameters": {
                    "shared_memory_region": "bench_in",
                    "shared_memory_byte_size": tensor.nbytes,
                },
            }
        ],
        "outputs": [
            {
                "name": "embedding",
                "parameters": {
                    "shared_memory_region": "bench_out",
                    "shared_memory_byte_size": 4096,
                },
            }
        ],
    }
    return json.dumps(doc).encode(), {"Content-Type": "application/json"}


async def _load(variant: str, url: str, grpc_target: str, seconds: float, tensor: Any) -> int:
    shm = variant.endswith("-shm")
    stop = time.monotonic() + seconds
    count = 0
    if variant.startswith("grpc"):
        body = _grpc_request(tensor, shm)
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            call = channel.unary_unary(METHOD)  # bytes in, bytes out: no client-side protobuf

            async def one_client() -> None:
                nonlocal count
                while time.monotonic() < stop:
                    await call(body)
                    count += 1

            await asyncio.gather(*(one_client() for _ in range(CONCURRENCY)))
        return count
    data, headers = _http_request(tensor, shm)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one_http_client() -> None:
            nonlocal count
            while time.monotonic() < stop:
                async with session.post(
                    f"{url}/v2/models/{MODEL}/infer", data=data, headers=headers
                ) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{variant}: HTTP {r.status}: {await r.text()}")
                count += 1

        await asyncio.gather(*(one_http_client() for _ in range(CONCURRENCY)))
    return count


def _register(url: str, tensor: np.ndarray, keep: list[shared_memory.SharedMemory]) -> bool:
    """The two regions, registered; False where the server has no shared-memory extension."""
    import httpx

    if "system_shared_memory" not in httpx.get(f"{url}/v2").json().get("extensions", []):
        return False
    regions = {"bench_in": tensor.nbytes, "bench_out": 4096}
    for name, size in regions.items():
        key = f"/clipbench_{os.getpid()}_{name}"
        region = shared_memory.SharedMemory(key.lstrip("/"), create=True, size=size)
        keep.append(region)
        if name == "bench_in":
            region.buf[: tensor.nbytes] = tensor.tobytes()
        body = {"key": key, "offset": 0, "byte_size": size}
        r = httpx.post(f"{url}/v2/systemsharedmemory/region/{name}/register", json=body)
        r.raise_for_status()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {client_core})
    tensor = np.random.default_rng(0).integers(0, 256, SHAPE, dtype=np.uint8)
    grpc_port = free_port()
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    keep: list[shared_memory.SharedMemory] = []
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--backend", "fake", "--backend-option", "compute=0", "--model"]
        flags += [str(tiny_model(Path(tmp))), "--pretrained", "none", "--gpus", "cpu"]
        flags += ["--cache-mb", "0", "--grpc-port", str(grpc_port), "--log-level", "warning"]
        flags += ["--max-queue-size", "1024", "--max-batch-size", "32", "--shm-max-regions", "8"]
        with clipserve_process(flags, cpus={server_core}) as (proc, url):
            server = psutil.Process(proc.pid)
            variants = list(VARIANTS)
            try:
                if not _register(url, tensor, keep):
                    variants = [v for v in variants if not v.endswith("-shm")]
                target = f"127.0.0.1:{grpc_port}"
                for variant in variants:  # warm-up: connections, first batches
                    asyncio.run(_load(variant, url, target, 1.0, tensor))
                for r in range(args.rounds):
                    for variant in rotated(variants, r):
                        cpu0 = sum(server.cpu_times()[:2])
                        t0 = time.monotonic()
                        n = asyncio.run(_load(variant, url, target, args.seconds, tensor))
                        elapsed = time.monotonic() - t0
                        cpu = sum(server.cpu_times()[:2]) - cpu0
                        result = {
                            "requests_per_s": round(n / elapsed, 1),
                            "server_cpu_us_per_request": round(cpu / n * 1e6, 1),
                        }
                        runs[variant].append(result)
                        print(f"round {r + 1} {variant}: {result}", flush=True)
            finally:
                for region in keep:
                    region.close()
                    region.unlink()
    measured = [v for v in VARIANTS if runs[v]]
    report: dict[str, Any] = {
        "benchmark": "grpc_vs_http",
        "when": utc_now(),
        "machine": machine(),
        "what": (
            "one clipserve process on one core (fake backend, compute=0), the client on the "
            f"other; UINT8 {list(SHAPE)} tensor requests, {CONCURRENCY} in flight, "
            f"{args.seconds:g} s per variant per round"
        ),
        "rounds": args.rounds,
        "requests_per_s": {v: spread([x["requests_per_s"] for x in runs[v]], 1) for v in measured},
        "server_cpu_us_per_request": {
            v: spread([x["server_cpu_us_per_request"] for x in runs[v]], 1) for v in measured
        },
        "runs": runs,
    }
    base = runs["http"]
    report["ratio_to_http"] = {
        v: spread(
            [b["requests_per_s"] / a["requests_per_s"] for a, b in zip(base, runs[v], strict=True)],
            2,
        )
        for v in measured
        if v != "http"
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
