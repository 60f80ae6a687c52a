"""Triton's model configuration for a served model, as `GET /v2/models/{m}/config` and gRPC's
ModelConfig answer it. Pure. Triton's perf_analyzer reads it first (batching, inputs and which
are optional); `tritonclient`'s `get_model_config` returns it.

The JSON form is the source (numbers stay numbers, as Triton's HTTP answer has them); the gRPC
message is parsed from it with the published `model_config.proto` classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from clipserve.backends.device import cuda_index
from clipserve.protocol.kserve import model_inputs, output_types

if TYPE_CHECKING:
    from clipserve.protocol.kserve import ServedModel

TYPES = {"BYTES": "TYPE_STRING", "UINT8": "TYPE_UINT8", "FP32": "TYPE_FP32", "FP16": "TYPE_FP16"}


@dataclass(frozen=True)
class Serving:
    """What the server runs a model with: its sizes, batching and devices."""

    size: tuple[int, int]  # the image tower's (height, width)
    embed_dim: int
    output: str  # --output-name
    max_items: int  # --max-items-per-request: Triton's max_batch_size
    max_batch_size: int  # the batcher's largest batch
    max_queue_delay_ms: float
    devices: Sequence[str]  # cpu, cuda:0, ...
    backend: str


def _instance_groups(devices: Sequence[str]) -> list[dict[str, Any]]:
    groups = []
    for i, device in enumerate(devices):
        gpu = cuda_index(device)
        if gpu is not None:
            groups.append({"name": f"gpu{gpu}", "kind": "KIND_GPU", "count": 1, "gpus": [gpu]})
        else:
            groups.append(
                {"name": f"{device.replace(':', '')}-{i}", "kind": "KIND_CPU", "count": 1}
            )
    return groups


def config_json(name: str, model: ServedModel, serving: Serving) -> dict[str, Any]:
    """Triton's JSON model configuration. Dimensions leave out the batch dimension, as
    Triton's do when max_batch_size > 0; the image model's alternative inputs are optional
    (a request sends exactly one), a per-kind model's one input is not."""
    inputs = [
        {
            "name": spec["name"],
            "data_type": TYPES[spec["datatype"]],
            "dims": spec["shape"][1:],
            "optional": model.tower == "image" and model.datatype is None,
        }
        for spec in model_inputs(model.tower, model.datatype, serving.size)
    ]
    outputs = [
        {"name": n, "data_type": TYPES[t], "dims": [serving.embed_dim]}
        for n, t in output_types(serving.output).items()
    ]
    return {
        "name": name,
        "platform": "clipserve",
        "backend": serving.backend,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": serving.max_items,
        "input": inputs,
        "output": outputs,
        "dynamic_batching": {
            "preferred_batch_size": [serving.max_batch_size],
            "max_queue_delay_microseconds": round(serving.max_queue_delay_ms * 1000),
        },
        "instance_group": _instance_groups(serving.devices),
    }


def model_config(name: str, model: ServedModel, serving: Serving) -> mc.ModelConfig:
    """The same configuration as gRPC's ModelConfigResponse holds it."""
    return json_format.ParseDict(config_json(name, model, serving), mc.ModelConfig())
