"""Wire formats measured: bytes per image, server CPU per image in-process, then over HTTP.

1. In-process, one thread, thread CPU time: parsing the body, decoding images (where there are
   any) and encoding a JSON response, per image, for each request format; bytes on the wire.
2. Over HTTP with the aiohttp load generator, each format at a fixed concurrency: against the
   fake backend (no model: what the protocol alone costs the server) and against ViT-B-32 on
   torch (the served rate with a real model on this machine).
Writes bench/results/protocols.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson

from bench.common import machine, utc_now
from bench.images import jpeg
from bench.loadgen import Request, run_load
from bench.served_vs_offline import start_server
from clipserve.backends.base import normalise_numpy
from clipserve.preprocess import ImageDecoder, PreprocessSpec
from clipserve.protocol.requests import parse_body
from clipserve.protocol.responses import encode_embeddings

SPEC = PreprocessSpec((224, 224), (0.48145466, 0.4578275, 0.40821073),
                      (0.26862954, 0.26130258, 0.27577711))  # fmt: skip
N = 8  # images per request for the list formats


def formats(images: list[bytes], decoder: ImageDecoder) -> dict[str, Request]:
    pixels = np.stack([decoder(d) for d in images[:N]])
    floats = normalise_numpy(pixels, SPEC)
    halfs = floats.astype(np.float16)

    def tensor(a: np.ndarray) -> bytes:
        return msgpack.packb({"tensor": {"dtype": str(a.dtype), "shape": list(a.shape),
                                         "data": a.tobytes()}})  # fmt: skip

    def raw(a: np.ndarray) -> Request:
        shape = ",".join(map(str, a.shape))
        headers = {"X-Tensor-Dtype": str(a.dtype), "X-Tensor-Shape": shape}
        return Request(a.tobytes(), "application/octet-stream", headers=headers)

    boundary = "clipservebench"
    multipart = b"".join(
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{i}.jpg\"\r\n"
        f"Content-Type: image/jpeg\r\n\r\n".encode() + d + b"\r\n" for i, d in enumerate(images[:N])
    ) + f"--{boundary}--\r\n".encode()  # fmt: skip
    return {
        "jpeg (1 per request)": Request(images[0], "image/jpeg"),
        "multipart jpeg": Request(multipart, f"multipart/form-data; boundary={boundary}"),
        "msgpack jpeg list": Request(msgpack.packb({"images": images[:N]}), "application/msgpack"),
        "json base64 jpeg": Request(
            orjson.dumps({"images": [base64.b64encode(d).decode() for d in images[:N]]}),
            "application/json",
        ),
        "msgpack uint8 tensor": Request(tensor(pixels), "application/msgpack"),
        "raw uint8 tensor": raw(pixels),
        "raw float16 tensor": raw(halfs),
        "raw float32 tensor": raw(floats),
        "msgpack float32 tensor": Request(tensor(floats), "application/msgpack"),
    }


def cpu_per_image(req: Request, decoder: ImageDecoder, repeat: int) -> dict[str, float]:
    headers = {k.lower(): v for k, v in req.headers.items()}
    embeddings = np.random.default_rng(0).standard_normal((N, 512)).astype(np.float32)

    def once() -> tuple[float, float, int]:
        t0 = time.thread_time()
        payload = parse_body(req.content_type, headers, req.body, (224, 224), 64)
        if payload.tensor is None:
            for data in payload.images:
                decoder(data)
        t1 = time.thread_time()
        n = len(payload)
        for media in ("application/json",):
            encode_embeddings(embeddings[:n], single=payload.single, meta={"model": "m"},
                              media=media)  # fmt: skip
        return t1 - t0, time.thread_time() - t1, n

    once()
    runs = [once() for _ in range(repeat)]
    n = runs[0][2]
    return {
        "images_per_request": n,
        "request_bytes_per_image": round(len(req.body) / n),
        "parse_and_decode_cpu_ms_per_image": round(
            statistics.median(r[0] for r in runs) / n * 1e3, 4
        ),
        "encode_json_cpu_ms_per_image": round(statistics.median(r[1] for r in runs) / n * 1e3, 4),
    }


def response_sizes() -> dict[str, int]:
    e = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
    e /= np.linalg.norm(e)
    out = {}
    for media, dtype in [("application/json", "float32"), ("application/msgpack", "float32"),
                         ("application/octet-stream", "float32"),
                         ("application/octet-stream", "float16")]:  # fmt: skip
        body, _ = encode_embeddings(e, single=False, meta={"model": "ViT-B-32/x",
                                    "normalized": True}, media=media, dtype=dtype)  # fmt: skip
        out[f"{media} {dtype}"] = len(body)
    return out


def served(server_args: list[str], reqs: dict[str, Request], in_flight: int, duration: float,
           port: int) -> list[dict[str, Any]]:  # fmt: skip
    """Each format with `in_flight` images outstanding: in_flight / images-per-request clients."""
    proc = start_server(server_args, port)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for name, req in reqs.items():
            n = N if "1 per" not in name else 1
            asyncio.run(run_load(url, req, concurrency=2, duration_s=1, images_per_request=n))
            clients = max(1, in_flight // n)
            result = asyncio.run(run_load(url, req, concurrency=clients, duration_s=duration,
                                          images_per_request=n))  # fmt: skip
            row = {"format": name, **asdict(result)}
            rows.append(row)
            print(
                f"  {name:<24} {result.images_per_s:8.1f} img/s  p50 "
                f"{result.latency_ms.get('p50', 0):8.1f} ms  {result.statuses}",
                flush=True,
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--in-flight", type=int, default=64, help="images outstanding")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--skip-model", action="store_true", help="only the fake backend")
    parser.add_argument("--out", type=Path, default=Path("bench/results/protocols.json"))
    args = parser.parse_args()
    decoder = ImageDecoder(SPEC, 40_000_000)
    images = [jpeg(640, 480, seed=i) for i in range(N)]
    reqs = formats(images, decoder)
    print("in-process, per image:", flush=True)
    in_process = {}
    for name, req in reqs.items():
        in_process[name] = cpu_per_image(req, decoder, args.repeat)
        print(f"  {name:<24} {in_process[name]}", flush=True)
    common = ["--model", "ViT-B-32", "--pretrained", "none", "--gpus", "cpu",
              "--max-batch-size", "32", "--max-queue-size", "256"]  # fmt: skip
    print(f"served, fake backend (no model), {args.in_flight} images in flight:", flush=True)
    fake = served([*common, "--backend", "fake"], reqs, args.in_flight, args.duration,
                  args.port)  # fmt: skip
    model: list[dict[str, Any]] = []
    if not args.skip_model:
        print("served, ViT-B-32 torch fp32 on CPU, 32 images in flight:", flush=True)
        chosen = {k: reqs[k] for k in ("jpeg (1 per request)", "msgpack jpeg list",
                                       "raw uint8 tensor", "raw float32 tensor")}  # fmt: skip
        model = served([*common, "--backend", "torch"], chosen, 32, args.duration * 2, args.port)
    doc = {
        "benchmark": "protocols",
        "machine": machine(),
        "input": f"640x480 JPEG q90 (list formats: {N} images per request)",
        "response_bytes_per_image": response_sizes(),
        "in_process": in_process,
        "served_fake_backend": fake,
        "served_vit_b32_cpu": model,
        "time": utc_now(),
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
