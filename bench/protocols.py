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
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import CLIP_SPEC, machine, utc_now
from clipserve.inference.preprocess import ImageDecoder
from clipserve.loadgen.images import SourceImage, synthetic_image
from clipserve.loadgen.loadgen import LoadSpec
from clipserve.loadgen.payloads import ModelInput, Request, build_requests
from clipserve.loadgen.procs import clipserve_server
from clipserve.loadgen.runner import run_point
from clipserve.protocol.requests import parse_body
from clipserve.protocol.responses import encode_embeddings

N = 8  # images per request for the list formats
# The formats served with the real model.
WITH_MODEL = ("jpeg (1 per request)", "msgpack jpeg list", "raw uint8 tensor", "raw float32 tensor")
RESPONSE_FORMATS = [
    ("application/json", "float32"),
    ("application/msgpack", "float32"),
    ("application/octet-stream", "float32"),
    ("application/octet-stream", "float16"),
]


def formats(images: list[SourceImage]) -> dict[str, Request]:
    """The request formats compared, from clipserve.loadgen's payload kinds."""
    model = ModelInput(CLIP_SPEC)

    def one(kind: str, n: int = N, dtype: str = "uint8") -> Request:
        return build_requests(
            kind, images, model, images_per_request=n, variants=1, tensor_dtype=dtype
        )[0]

    return {
        "jpeg (1 per request)": one("jpeg", 1),
        "multipart jpeg": one("multipart"),
        "msgpack jpeg list": one("msgpack-images"),
        "json base64 jpeg": one("json-base64"),
        "msgpack uint8 tensor": one("msgpack-tensor"),
        "raw uint8 tensor": one("raw-tensor"),
        "raw float16 tensor": one("raw-tensor", dtype="float16"),
        "raw float32 tensor": one("raw-tensor", dtype="float32"),
        "msgpack float32 tensor": one("msgpack-tensor", dtype="float32"),
    }


def cpu_per_image(req: Request, decoder: ImageDecoder, repeat: int) -> dict[str, float]:
    headers = {k.lower(): v for k, v in req.headers.items() if k.lower() != "content-type"}
    content_type = req.headers["Content-Type"]
    embeddings = np.random.default_rng(0).standard_normal((N, 512)).astype(np.float32)

    def once() -> tuple[float, float, int]:
        t0 = time.thread_time()
        payload = parse_body(content_type, headers, req.body, (224, 224), 64)
        if payload.tensor is None:
            for data in payload.images:
                decoder(data)
        t1 = time.thread_time()
        n = len(payload)
        meta = {"model": "m"}
        for media in ("application/json",):
            encode_embeddings(embeddings[:n], single=payload.single, meta=meta, media=media)
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
    meta = {"model": "ViT-B-32/x", "normalized": True}
    out = {}
    for media, dtype in RESPONSE_FORMATS:
        body, _ = encode_embeddings(e, single=False, meta=meta, media=media, dtype=dtype)
        out[f"{media} {dtype}"] = len(body)
    return out


def served(
    server_args: list[str], reqs: dict[str, Request], in_flight: int, duration: float
) -> list[dict[str, Any]]:
    """Each format with `in_flight` images outstanding: in_flight / images-per-request clients."""
    rows = []
    with clipserve_server(server_args) as url:
        for name, req in reqs.items():
            clients = max(1, in_flight // req.items)
            spec = LoadSpec(concurrency=clients, duration_s=duration, warmup_s=1.0)
            result = run_point(url, [req], spec)
            rows.append({"format": name, **result.to_dict()})
            print(
                f"  {name:<24} {result.images_per_s:8.1f} img/s  p50 "
                f"{result.latency_ms.get('p50', 0):8.1f} ms  {result.statuses}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--in-flight", type=int, default=64, help="images outstanding")
    parser.add_argument("--skip-model", action="store_true", help="only the fake backend")
    parser.add_argument("--out", type=Path, default=Path("bench/results/protocols.json"))
    args = parser.parse_args()
    decoder = ImageDecoder(CLIP_SPEC, 40_000_000)
    reqs = formats([SourceImage(synthetic_image(640, 480, seed=i)) for i in range(N)])
    print("in-process, per image:", flush=True)
    in_process = {}
    for name, req in reqs.items():
        in_process[name] = cpu_per_image(req, decoder, args.repeat)
        print(f"  {name:<24} {in_process[name]}", flush=True)
    common = ["--model", "ViT-B-32", "--pretrained", "none", "--gpus", "cpu"]
    common += ["--max-batch-size", "32", "--max-queue-size", "256"]
    print(f"served, fake backend (no model), {args.in_flight} images in flight:", flush=True)
    fake = served([*common, "--backend", "fake"], reqs, args.in_flight, args.duration)
    model: list[dict[str, Any]] = []
    if not args.skip_model:
        print("served, ViT-B-32 torch fp32 on CPU, 32 images in flight:", flush=True)
        chosen = {k: reqs[k] for k in WITH_MODEL}
        model = served([*common, "--backend", "torch"], chosen, 32, args.duration * 2)
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
