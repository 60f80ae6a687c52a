"""`GET /info`: the model card, one builder for the server and the client's local mode."""

from __future__ import annotations

from typing import Any

from clipserve.config import ServerConfig
from clipserve.http.names import ServedNames
from clipserve.http.pipeline import Serving


def info_card(runtime: Serving, config: ServerConfig, names: ServedNames) -> dict[str, Any]:
    """What the served model is and how it is served: what a client needs to build requests
    (sizes, layouts, mean/std, limits) and to know which vectors it gets (model, weights)."""
    model = runtime.model
    b, limits, http = config.batching, config.limits, config.http
    return {
        "model": model.identity,
        "model_name": model.name,
        "weights": model.weights_id,
        "names": names.card(),
        "embed_dim": model.embed_dim,
        "input_size": list(model.preprocess.size),
        "input_layout": {"uint8": "NHWC", "float32": "NCHW", "float16": "NCHW"},
        "mean": list(model.preprocess.mean),
        "std": list(model.preprocess.std),
        "interpolation": model.preprocess.interpolation,
        "resize_mode": model.preprocess.resize_mode,
        "backend": runtime.backend,
        "precision": runtime.precision,
        "devices": runtime.devices,
        "self_check": runtime.self_check,
        "jpeg_decoder": jpeg_decoder(runtime, config),
        "jpeg_scaling": runtime.decoder.jpeg_scaling,  # --jpeg-scaling, on the CPU path
        "batching": {
            "max_batch_size": b.max_batch_size,
            "max_queue_size": b.max_queue_size,
            "max_queue_delay_ms": b.max_queue_delay_ms,
            "pipeline_depth": b.pipeline_depth,
        },
        "text": {
            "context_length": model.context_length,
            "max_text_chars": limits.max_text_chars,
            "truncate": limits.truncate_text,
        },
        "limits": {
            "max_body_bytes": limits.max_body_bytes,
            "max_image_pixels": limits.max_image_pixels,
            "max_image_aspect": limits.max_image_aspect,
            "max_decode_bytes": limits.max_decode_bytes,
            "max_items_per_request": limits.max_items_per_request,
            "max_body_bytes_in_flight": limits.max_body_bytes_in_flight,
            "request_timeout_s": limits.request_timeout_s,
            "max_connections": http.max_connections,
            "max_header_bytes": http.max_header_bytes,
            "header_timeout_s": http.header_timeout_s,
        },
    }


def jpeg_decoder(runtime: Serving, config: ServerConfig) -> str:
    """Which decoder turns JPEGs into crops: the host's ("pillow", or the fast path's simplejpeg
    + torch), or with --decode gpu torchvision's on each device, the host's for what it hands
    back (PNG, CMYK, refusals)."""
    host = runtime.decoder.jpeg_decoder
    if config.backend.decode == "gpu":
        return f"torchvision decode_jpeg on the device (nvJPEG on CUDA); host: {host}"
    return host
