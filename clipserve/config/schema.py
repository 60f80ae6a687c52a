"""The configuration's shape: one frozen dataclass per section, each field's metadata holding
its help text and choices, and `validate`, which every ServerConfig runs when built (so a
config built in code is checked like one built from flags)."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clipserve.errors import ConfigError

ENV_PREFIX = "CLIPSERVE_"
PRECISIONS = ("fp32", "fp16")
DECODERS = ("cpu", "gpu")
JPEG_SCALINGS = ("parity", "fast")
SELF_CHECKS = ("auto", "strict", "warn", "off")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMATS = ("text", "json")


def _opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt("ViT-B-32", "open_clip model name, or a path to an open_clip JSON config")
    pretrained: str = _opt(
        "laion2b_s34b_b79k", "open_clip pretrained tag; 'none' = random weights (testing only)"
    )
    checkpoint: str | None = _opt(None, "local weights (.pt state dict or .safetensors)")
    cache_dir: str = _opt(
        str(Path.home() / ".cache" / "clipserve"), "where exported models and engines are kept"
    )
    served_model_name: tuple[str, ...] = _opt(
        (),
        "the name clients call the model by (repeatable: aliases; the first names the answers): "
        "OpenAI's model and KServe's image model; default: the model name (OpenAI: and "
        "name/weights)",
    )
    served_text_model_name: tuple[str, ...] = _opt(
        (), "KServe's text model (repeatable); default: each served model name + '-text'"
    )
    output_name: str = _opt(
        "embedding", "KServe output holding the FP32 embedding; NAME_fp16 holds the FP16 one"
    )


@dataclass(frozen=True)
class BackendConfig:
    backend: str = _opt("auto", "executor: auto, torch, fake, ...  (auto logs its choice)")
    gpus: str = _opt("auto", "'auto' (first visible GPU, else CPU), 'cpu', or ids such as 0,1")
    precision: str | None = _opt(None, "fp32 or fp16; default: the backend's", choices=PRECISIONS)
    threads: int = _opt(0, "intra-op threads for CPU inference; 0 = one per core")
    compile: bool = _opt(False, "torch backends: compile the model with torch.compile")
    batch_buckets: str = _opt(
        "", "cuda-graphs: batch sizes to capture, e.g. 1,4,16,32; default: powers of two"
    )
    decode: str = _opt(
        "cpu",
        "where JPEGs are decoded: cpu (the decode pool: simplejpeg, else Pillow) or gpu (in "
        "batches on each device by nvJPEG, just before the forward pass; on a CPU device, "
        "torchvision's)",
        choices=DECODERS,
    )
    jpeg_scaling: str = _opt(
        "parity",
        "how far the CPU path may shrink a JPEG as it decodes it (libjpeg's DCT scaling): parity "
        "(to at least twice the model's input size: within 0.5 levels of open_clip's preprocess) "
        "or fast (to the input size, as Pillow's draft: up to 4.7 levels, tensor cosine 0.990; "
        "about 1.5x the JPEGs per core at 640x480)",
        choices=JPEG_SCALINGS,
    )
    backend_option: tuple[str, ...] = _opt(
        (), "KEY=VALUE passed to the executor (repeatable; env: comma-separated)"
    )
    self_check: str = _opt(
        "auto",
        "canary images through the served path against a CPU FP32 reference after warm-up: "
        "strict (unready below the floor), warn, off; auto: strict on CUDA, warn on CPU",
        choices=SELF_CHECKS,
    )

    def options(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.backend_option)


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = _opt(32, "most images in one forward pass; default on CUDA devices: 256")
    max_queue_size: int = _opt(
        256,
        "most images admitted and not yet computing; more get 503; default on CUDA devices: "
        "4 x batch x devices",
    )
    max_queue_delay_ms: float = _opt(
        10.0,
        "how long a short batch may wait, after its oldest image, for images already admitted "
        "and still decoding (never for requests not yet arrived); 0 = take what is queued",
    )
    pipeline_depth: int = _opt(
        2,
        "batches in flight per device where the executor runs asynchronously (CUDA; the fake "
        "backend's stream=1): the next is taken and copied while one computes; 1 = one at a time",
    )


@dataclass(frozen=True)
class LimitsConfig:
    request_timeout_s: float = _opt(30.0, "whole-request deadline, receiving the body included")
    max_body_bytes: int = _opt(32 * 1024 * 1024, "largest request body")
    max_body_bytes_in_flight: int = _opt(
        256 * 1024 * 1024, "most bytes of request bodies held in memory at once; more get 503"
    )
    max_image_pixels: int = _opt(40_000_000, "largest decoded image (width x height)")
    max_image_aspect: float = _opt(200.0, "most an image's longer side may exceed its shorter")
    max_decode_bytes: int = _opt(
        256 * 1024 * 1024, "most memory decoding one image may take, estimated from its header"
    )
    max_items_per_request: int = _opt(64, "most images in one request")
    max_text_chars: int = _opt(1000, "longest text in characters, on every route")
    shm_max_regions: int = _opt(
        0,
        "most system shared-memory regions registered at once; 0: Triton's system shared "
        "memory is off. A client that may register regions reads and writes whatever the "
        "server's user can open in /dev/shm: turn it on for trusted clients on the host only",
    )
    shm_max_bytes: int = _opt(1 << 30, "most bytes of the registered regions together")
    truncate_text: bool = _opt(
        False,
        "texts over the model's context (77 tokens for CLIP) are cut to fit, as Infinity "
        "does; default: refused with 400 (as OpenAI does); OpenAI's route also takes a "
        'per-request "truncate": "END" or "NONE"',
    )
    decode_workers: int = _opt(
        0, "threads decoding images; 0 = one per core (GPU) or per 8 cores (CPU inference)"
    )


@dataclass(frozen=True)
class HttpConfig:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    grpc_port: int = _opt(
        8001, "port of the KServe v2 / Triton gRPC service (Triton's default) on --host; 0: off"
    )
    grpc_max_connection_idle_s: float = _opt(
        300.0,
        "a gRPC connection with no call for this long is closed (GOAWAY), so idle channels do "
        "not hold sockets; 0 = never",
    )
    grpc_max_connection_age_s: float = _opt(
        0.0,
        "a gRPC connection older than this is closed gracefully (GOAWAY; calls in flight get "
        "--request-timeout-s), so clients reconnect and spread over replicas added since; "
        "0 = never",
    )
    workers: int = _opt(
        1,
        "HTTP front-end processes sharing the port; above 1 they feed one engine process "
        "(model, batcher, devices) through shared memory",
    )
    reuse_port: bool = _opt(
        False,
        "--workers N on Linux: each front end listens on a socket of its own (SO_REUSEPORT) and "
        "the kernel spreads new connections over them evenly; default: one socket for all, whose "
        "accept queue outlives a killed front end, but a burst of connections may gather on one",
    )
    log_level: str = _opt("info", "log level", choices=LOG_LEVELS)
    log_format: str = _opt(
        "text",
        "text, or json: one object per line (time, level, logger, role, message, exception), "
        "and an access line per request (id, method, route, status, duration, items, client, key)",
        choices=LOG_FORMATS,
    )
    otel_endpoint: str = _opt(
        "",
        "OTLP/HTTP collector for OpenTelemetry traces, e.g. http://otel-collector:4318 (path "
        "default /v1/traces): a span per HTTP request and gRPC call, one per stage, W3C "
        "traceparent (header or gRPC metadata) followed; "
        "needs the otel extra; empty: off",
    )
    shutdown_delay_s: float = _opt(
        0.0,
        "on SIGTERM, first answer readiness 503 and go on serving this long, so load "
        "balancers that probe stop sending before the listener closes; then drain",
    )
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, how long in-flight requests may finish")
    heartbeat_timeout_s: float = _opt(
        10.0,
        "--workers N: a process whose event loop is silent this long, or whose device batch "
        "runs this long past its measured time, is hung: /readyz answers 503, the supervisor "
        "kills and restarts it",
    )
    engine_start_timeout_s: float = _opt(
        600.0,
        "--workers N: how long the engine process may take to load and warm up its model (a "
        "first TensorRT build included) before it is killed as hung",
    )
    max_connections: int = _opt(
        1000,
        "most open HTTP connections per front end (past them: 503, probes and scrapes "
        "served) and gRPC calls running (past them: UNAVAILABLE)",
    )
    max_header_bytes: int = _opt(65536, "most bytes of request line and headers; more get 431")
    header_timeout_s: float = _opt(
        10.0,
        "a request's headers must arrive within this, and a client must take some of its "
        "answer within this; idle, slower or stalled connections are closed",
    )
    keep_alive_timeout_s: float = _opt(5.0, "an idle kept-alive connection is closed after this")
    linger_timeout_s: float = _opt(
        5.0, "after answering before the body is read, how long to read and drop the rest"
    )
    ssl_certfile: str | None = _opt(None, "PEM certificate: serve HTTPS (with --ssl-keyfile)")
    ssl_keyfile: str | None = _opt(None, "PEM private key for --ssl-certfile")

    @property
    def stop_limit_s(self) -> float:
        """How long a front end may take to stop after SIGTERM: the delay, the drain, and a
        margin for its exit; the supervisor and the engine wait this long for the front ends."""
        return self.shutdown_delay_s + self.drain_timeout_s + 10.0


@dataclass(frozen=True)
class CacheConfig:
    cache_mb: int = _opt(
        256,
        "embedding cache in MiB, in the engine (shared by every front end; identical items in "
        "flight are computed once); 0 = off",
    )


@dataclass(frozen=True)
class AccessConfig:
    api_keys: str | None = _opt(
        None,
        "file of API keys, one per line: KEY, NAME:KEY or NAME:KEY:RATE[:BURST]; reloaded on "
        "SIGHUP or change; requests need one (Authorization: Bearer, or X-API-Key)",
    )
    rate_limit: str | None = _opt(
        None,
        "items (images and texts) per second per key, RATE[:BURST] (token bucket; burst "
        "default: one second's worth); over it: 429",
    )
    protect_metrics: bool = _opt(False, "with --api-keys, /metrics needs a key too")
    allow_url_fetch: tuple[str, ...] = _opt(
        (),
        "host names and CIDRs image URLs may be fetched from (repeatable; env: comma-separated); "
        "empty: URLs are refused",
    )
    url_timeout_s: float = _opt(10.0, "an image URL's whole fetch, connecting included")
    url_max_bytes: int = _opt(20 * 1024 * 1024, "largest image fetched from a URL")
    url_fetch_concurrency: int = _opt(16, "most image URLs fetched at once, per process")


@dataclass(frozen=True)
class ServerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    # Options left to their defaults by load_config (no flag, no variable): those with a device
    # default (see resolve_device_defaults) take it. Empty when built directly: all explicit.
    defaulted: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        validate(self)


SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig,
    "backend": BackendConfig,
    "batching": BatchingConfig,
    "limits": LimitsConfig,
    "http": HttpConfig,
    "cache": CacheConfig,
    "access": AccessConfig,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{_flag(name)}: {message}")


def validate(config: ServerConfig) -> None:
    """Reject values that cannot work, naming the flag. Called when a ServerConfig is built."""
    b, lim, h, be = config.batching, config.limits, config.http, config.backend
    _require(b.max_batch_size >= 1, "max_batch_size", "must be at least 1")
    _require(
        b.max_queue_size >= b.max_batch_size,
        "max_queue_size",
        f"must be at least --max-batch-size ({b.max_batch_size})",
    )
    _require(b.max_queue_delay_ms >= 0, "max_queue_delay_ms", "must not be negative")
    _require(1 <= b.pipeline_depth <= 8, "pipeline_depth", "must be in 1..8")
    _require(lim.request_timeout_s > 0, "request_timeout_s", "must be positive")
    _require(lim.max_body_bytes >= 1024, "max_body_bytes", "must be at least 1024")
    _require(
        lim.max_body_bytes_in_flight >= lim.max_body_bytes,
        "max_body_bytes_in_flight",
        f"must be at least --max-body-bytes ({lim.max_body_bytes})",
    )
    _require(lim.max_image_pixels >= 1, "max_image_pixels", "must be positive")
    _require(lim.max_image_aspect >= 1, "max_image_aspect", "must be at least 1")
    _require(lim.max_decode_bytes >= 1 << 20, "max_decode_bytes", "must be at least 1 MiB")
    _require(lim.max_text_chars >= 1, "max_text_chars", "must be at least 1")
    _check_names(config.model)
    _require(lim.max_items_per_request >= 1, "max_items_per_request", "must be at least 1")
    _require(
        lim.max_items_per_request <= b.max_queue_size,
        "max_items_per_request",
        f"must not exceed --max-queue-size ({b.max_queue_size}): such a request could never run",
    )
    _require(lim.decode_workers >= 0, "decode_workers", "must not be negative (0 = auto)")
    _require(be.threads >= 0, "threads", "must not be negative (0 = auto)")
    _require(be.decode in DECODERS, "decode", f"must be one of {', '.join(DECODERS)}")
    _require(
        be.jpeg_scaling in JPEG_SCALINGS,
        "jpeg_scaling",
        f"must be one of {', '.join(JPEG_SCALINGS)}",
    )
    _require(
        be.precision is None or be.precision in PRECISIONS,
        "precision",
        f"must be one of {', '.join(PRECISIONS)}",
    )
    _require(
        re.fullmatch(r"auto|cpu|\d+(,\d+)*", be.gpus.replace(" ", "")) is not None,
        "gpus",
        f"expected 'auto', 'cpu' or a list of ids such as 0,1; got {be.gpus!r}",
    )
    _require(
        re.fullmatch(r"(\d+(,\d+)*)?", be.batch_buckets.replace(" ", "")) is not None,
        "batch_buckets",
        f"expected a list of batch sizes such as 1,8,32; got {be.batch_buckets!r}",
    )
    for item in be.backend_option:
        _require("=" in item, "backend_option", f"expected KEY=VALUE, got {item!r}")
    _require(0 <= h.port <= 65535, "port", "must be in 0..65535")
    grpc_ok = h.grpc_port == 0 or (0 < h.grpc_port <= 65535 and h.grpc_port != h.port)
    _require(grpc_ok, "grpc_port", "must be in 0..65535 (0: off), not --port")
    for name in ("grpc_max_connection_idle_s", "grpc_max_connection_age_s"):
        _require(getattr(h, name) >= 0, name, "must not be negative (0 = never)")
    _require(1 <= h.workers <= 256, "workers", "must be in 1..256")
    _require(
        not h.reuse_port or sys.platform == "linux",
        "reuse_port",
        "needs Linux, where SO_REUSEPORT spreads connections over the sockets",
    )
    _require(h.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
    _require(h.log_format in LOG_FORMATS, "log_format", f"must be one of {', '.join(LOG_FORMATS)}")
    _check_otel(h.otel_endpoint)
    _require(h.shutdown_delay_s >= 0, "shutdown_delay_s", "must not be negative")
    _require(h.drain_timeout_s >= 0, "drain_timeout_s", "must not be negative")
    _require(
        h.heartbeat_timeout_s >= 1,
        "heartbeat_timeout_s",
        "must be at least 1 (a process stamps its heartbeat every 0.5 s)",
    )
    _require(h.engine_start_timeout_s > 0, "engine_start_timeout_s", "must be positive")
    _require(h.max_connections >= 1, "max_connections", "must be at least 1")
    _require(h.max_header_bytes >= 1024, "max_header_bytes", "must be at least 1024")
    _require(h.header_timeout_s > 0, "header_timeout_s", "must be positive")
    _require(h.keep_alive_timeout_s > 0, "keep_alive_timeout_s", "must be positive")
    _require(h.linger_timeout_s >= 0, "linger_timeout_s", "must not be negative (0: no linger)")
    _require(
        (h.ssl_certfile is None) == (h.ssl_keyfile is None),
        "ssl_keyfile",
        "--ssl-certfile and --ssl-keyfile go together",
    )
    _require(config.cache.cache_mb >= 0, "cache_mb", "must not be negative (0 = off)")
    a = config.access
    _require(
        a.rate_limit is None or _RATE.fullmatch(a.rate_limit) is not None,
        "rate_limit",
        f"expected RATE or RATE:BURST in items per second, both positive, e.g. 50:100; got "
        f"{a.rate_limit!r}",
    )
    _require(not a.protect_metrics or a.api_keys is not None, "protect_metrics", "needs --api-keys")
    _require(a.url_timeout_s > 0, "url_timeout_s", "must be positive")
    _require(a.url_max_bytes >= 1024, "url_max_bytes", "must be at least 1024")
    _require(a.url_fetch_concurrency >= 1, "url_fetch_concurrency", "must be at least 1")


# --rate-limit and a key file's RATE[:BURST]: a positive rate, a burst of at least 1 item.
_RATE = re.compile(r"(?!0*(\.0*)?(:|$))\d+(\.\d+)?(:0*[1-9]\d*)?")

# What a served name may be: visible ASCII without spaces, up to 128 characters (slashes
# included, as Hugging Face ids and NIM's "nvidia/nvclip" have).
_NAME = re.compile(r"[!-~]{1,128}")


def _check_otel(endpoint: str) -> None:
    """--otel-endpoint: a URL, and the packages that export to it (checked here, so that a
    missing extra is one line at startup in every process layout, not a failing front end)."""
    if not endpoint:
        return
    _require(
        re.fullmatch(r"https?://[^\s/?#]+(/\S*)?", endpoint) is not None,
        "otel_endpoint",
        f"expected an http:// or https:// URL, got {endpoint[:100]!r}",
    )
    try:
        found = all(
            importlib.util.find_spec(name) is not None
            for name in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http")
        )
    except (ImportError, ValueError):  # a parent package missing, or blocked
        found = False
    _require(found, "otel_endpoint", "needs OpenTelemetry: pip install 'clipserve[otel]'")


def _check_names(m: ModelConfig) -> None:
    for option, names in (
        ("served_model_name", m.served_model_name),
        ("served_text_model_name", m.served_text_model_name),
        ("output_name", (m.output_name,)),
    ):
        for name in names:
            problem = f"{name[:40]!r}: 1 to 128 visible ASCII characters, no spaces"
            _require(_NAME.fullmatch(name) is not None, option, problem)
        _require(len(set(names)) == len(names), option, "a name is given twice")
    texts = set(m.served_text_model_name)
    _require(not set(m.served_model_name) & texts, "served_text_model_name", "serves both towers")
    # KServe's per-kind image models (http/names.py) take <name>-bytes, -uint8, -fp32, -fp16.
    kinds = {n + k for n in m.served_model_name for k in ("-bytes", "-uint8", "-fp32", "-fp16")}
    _require(not kinds & texts, "served_text_model_name", "a per-kind image model has that name")
