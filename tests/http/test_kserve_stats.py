"""Triton's model statistics from the server's own counters, read with the real tritonclient
over HTTP and gRPC: counts go up by exactly what was sent, failures are counted, and the batch
statistics are the batches the (fake) device ran."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from clipserve.backends.fake import FakeExecutor
from tests.helpers import Serve, free_port, model_name, png_bytes, random_pixels


def _bytes(elements: list[bytes], lib: Any, name: str = "image") -> Any:
    inp = lib.InferInput(name, [len(elements), 1], "BYTES")
    inp.set_data_from_numpy(np.array(elements, dtype=np.object_).reshape(-1, 1))
    return inp


def test_statistics_count_what_was_served(serve: Serve) -> None:
    server = serve(grpc_port=free_port(), backend="fake", max_batch_size=4, max_queue_delay_ms=1)
    name = model_name(server)
    executor = server.state.runtime.executors[0]
    assert isinstance(executor, FakeExecutor)
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = tg.InferenceServerClient(f"127.0.0.1:{server.app.state.grpc_port}")
    try:
        before = http.get_inference_statistics(name)["model_stats"][0]
        batches_before = list(executor.batches)
        for i in range(3):
            images = [png_bytes(random_pixels(10 * i + j)) for j in range(2)]
            http.infer(name, [_bytes(images, th)])
        grpc.infer(name + "-bytes", [_bytes([png_bytes(random_pixels(99))], tg)])
        with pytest.raises(InferenceServerException):
            http.infer(name, [_bytes([b"not an image"], th)])
        grpc.infer(name + "-text", [_bytes([b"a cat", b"a dog"], tg, "text")])

        after = http.get_inference_statistics(name)["model_stats"][0]
        over_grpc = grpc.get_inference_statistics(name + "-uint8").model_stats[0]
        everything = http.get_inference_statistics()["model_stats"]
    finally:
        http.close()
        grpc.close()
    stats = after["inference_stats"]
    assert after["name"] == name and after["version"] == "1"
    assert stats["success"]["count"] - before["inference_stats"]["success"]["count"] == 4
    assert stats["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 1
    assert after["inference_count"] - before["inference_count"] == 7
    assert after["last_inference"] > 0 and stats["compute_infer"]["ns"] > 0
    for field in ("queue", "compute_input", "compute_output"):
        assert stats[field]["count"] == stats["success"]["count"]
    # The batches the device ran, by size: exactly the executor's own record.
    ran = collections.Counter(executor.batches[len(batches_before) :])
    grew = collections.Counter(
        {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    )
    grew.subtract({b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]})
    assert +grew == ran
    assert after["execution_count"] - before["execution_count"] == sum(ran.values())
    # Every name of the image tower reports its numbers; the text model its own.
    assert over_grpc.inference_stats.success.count == stats["success"]["count"]
    by_name = {m["name"]: m for m in everything}
    assert by_name[name + "-text"]["inference_stats"]["success"]["count"] >= 1
    assert by_name[name + "-text"]["inference_count"] >= 2
    assert set(by_name) >= {name, name + "-text", name + "-fp16"}
