"""Triton's front end and dynamic batcher with no model work, for the cost section: PyTriton
serving one model, `clip`, that takes a UINT8 [-1, 224, 224, 3] image and answers a fixed
512-float FP32 embedding (clipserve's fake backend with compute=0 does the same). Run by the
PyTriton interpreter (`make pytriton-env`), not the project's: it imports only pytriton and
numpy. `--host/--port` as the other servers take them; its gRPC and metrics ports are free
ones picked here."""

from __future__ import annotations

import argparse
import socket

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

EMBEDDING = np.random.default_rng(0).standard_normal(512).astype(np.float32)


@batch
def infer(image: np.ndarray) -> dict[str, np.ndarray]:
    return {"embedding": np.tile(EMBEDDING, (image.shape[0], 1))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue-delay-us", type=int, default=1000)
    a = p.parse_args()
    config = TritonConfig(
        http_address=a.host,
        http_port=a.port,
        grpc_port=_free_port(),
        metrics_port=_free_port(),
        log_verbose=0,
    )
    batcher = DynamicBatcher(max_queue_delay_microseconds=a.max_queue_delay_us)
    with Triton(config=config) as triton:
        triton.bind(
            model_name="clip",
            infer_func=infer,
            inputs=[Tensor(name="image", dtype=np.uint8, shape=(224, 224, 3))],
            outputs=[Tensor(name="embedding", dtype=np.float32, shape=(512,))],
            config=ModelConfig(max_batch_size=256, batcher=batcher),
        )
        triton.serve()


if __name__ == "__main__":
    main()
