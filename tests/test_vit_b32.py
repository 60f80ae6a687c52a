"""The real ViT-B-32 architecture, random weights from a checkpoint written here, served."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import open_clip
import pytest
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image

from clipserve.config import load_config
from clipserve.loadgen.images import jpeg
from tests.helpers import (
    PNG,
    min_cosine,
    png_bytes,
    random_pixels,
    reference_embedding,
    running,
    visual_reference,
)

pytestmark = pytest.mark.slow


def test_vit_b32_served_matches_open_clip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    checkpoint = tmp_path / "vit-b-32.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(checkpoint))
    config = load_config(
        {
            "model": "ViT-B-32",
            "checkpoint": str(checkpoint),
            "backend": "torch",
            "gpus": "cpu",
            "max_batch_size": "4",
        },
        environ={},
    )
    with running(config) as server:
        info = httpx.get(server.url + "/info").json()
        assert info["embed_dim"] == 512 and info["input_size"] == [224, 224]

        pixels = random_pixels(11)  # identical pixels: equal to a direct model call
        r = httpx.post(server.url + "/embed", content=png_bytes(pixels), headers=PNG, timeout=60)
        want = reference_embedding(model, pixels)
        np.testing.assert_allclose(r.json()["embedding"], want, atol=1e-5)

        data = jpeg(640, 480, seed=4)  # a JPEG: open_clip's whole pipeline, fast decode allowed
        r = httpx.post(
            server.url + "/embed", content=data, headers={"Content-Type": "image/jpeg"}, timeout=60
        )
        transform = image_transform_v2(
            PreprocessCfg(**open_clip.get_model_preprocess_cfg(model)), is_train=False
        )
        with torch.inference_mode():
            ref = model.encode_image(transform(Image.open(io.BytesIO(data)))[None], normalize=True)
        assert float(np.dot(r.json()["embedding"], ref[0].numpy())) >= 0.999


def test_vit_b32_onnx_export_matches_pytorch(tmp_path: Path) -> None:
    """The real architecture through the exporter and ONNX Runtime (its attention blocks are
    where export problems show up), against PyTorch FP32."""
    from clipserve.backends.base import ExecutorSpec
    from clipserve.backends.registry import create_executor

    config = load_config(
        {
            "model": "ViT-B-32",
            "pretrained": "none",
            "backend": "ort-cpu",
            "gpus": "cpu",
            "max_batch_size": "4",
            "cache_dir": str(tmp_path),
        },
        environ={},
    )
    from clipserve.inference.model import load_model

    model = load_model(config.model)
    executor = create_executor(model, ExecutorSpec.from_config(config), "cpu")
    x = np.random.default_rng(0).integers(0, 256, (4, 224, 224, 3), dtype=np.uint8)
    got = executor.run(x)
    assert min_cosine(got, visual_reference(model, x)) >= 0.99999
