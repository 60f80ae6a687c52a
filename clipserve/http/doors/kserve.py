"""Open Inference Protocol (KServe v2) routes, as Triton serves them over HTTP: health, server
and model metadata, and inference through the pipeline.

Two models, each with one version, "1": the image tower, called the model's name (or each
--served-model-name), and the text tower, called that + "-text" (or each
--served-text-model-name). Names may hold slashes (Hugging Face ids), as Triton's clients send
them unquoted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from clipserve.batching.tower import TowerKind
from clipserve.config import LimitsConfig
from clipserve.http import health, stats
from clipserve.http.door import inference_route
from clipserve.http.doors.kserve_shm import shared_memory_routes
from clipserve.http.names import KServeModel, resolve_model
from clipserve.http.pipeline import Pipeline, Serving, pipeline_of
from clipserve.http.shm_regions import SharedMemoryRegions
from clipserve.http.work import Embedded, Encoded, ImageWork, TextWork, Work
from clipserve.protocol import kserve as codec
from clipserve.protocol import triton_model
from clipserve.protocol.media import JSON
from clipserve.protocol.shm import FitRegion


def _json(doc: object) -> Response:
    return Response(orjson.dumps(doc), media_type=JSON)


def _empty(ok: bool) -> Response:
    """Health answers: the status is the answer, the body is empty (as the protocol asks)."""
    return Response(status_code=200 if ok else 503)


def _model(request: Request) -> tuple[str, KServeModel]:
    """The model the path names (404 for any other model or version)."""
    name: str = request.path_params["name"]
    version = request.path_params.get("version", codec.VERSION)
    return resolve_model(pipeline_of(request).names, name, version)


INLINE_HEADER_BYTES = 4096  # a binary request's JSON header short enough to parse inline


def _length(raw: str | None) -> int | None:
    raw = (raw or "").strip()
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 19 else None


def _inline(header_length: str | None, content_length: str | None) -> bool:
    """A short JSON header and binary data after it (the body is longer): parsing is a few
    checks and a view. A body that is all header (JSON data, or an input in shared memory,
    whose read is a copy of up to max items x 150 KB) goes to the pool; an input in shared
    memory with binary data after its header is refused before any read."""
    header, body = _length(header_length), _length(content_length)
    if header is None or body is None:  # chunked: how much follows the header is unknown
        return False
    return header <= INLINE_HEADER_BYTES and body > header


def work_of(
    parsed: codec.InferRequest,
    tower: TowerKind,
    runtime: Serving,
    limits: LimitsConfig,
    fits: FitRegion | None = None,
) -> Work[codec.InferRequest]:
    """A parsed inference request (HTTP or gRPC) as the pipeline's work: texts tokenised here,
    in the pool, like the parsing before them. An output bound for a shared-memory region
    that is not registered or too small is refused now (`fits`), not once computed."""
    if fits is not None:
        rows = parsed.count
        for output in parsed.outputs:
            if output.region is not None:
                itemsize = np.dtype(codec.DTYPES[output.datatype]).itemsize
                fits(output.region, rows * runtime.model.embed_dim * itemsize)
    work = Work(parsed.protocol, parsed, held_bytes=parsed.shared_bytes)
    if tower == "text":
        tokens = runtime.tokenize(parsed.texts, truncate=limits.truncate_text)
        work.texts = TextWork(parsed.protocol, parsed.texts, tokens)
    else:
        work.images = ImageWork(parsed.protocol, parsed.images, tensor=parsed.tensor)
    return work


@dataclass(frozen=True)
class Infer:
    """`POST /v2/models/{name}[/versions/{version}]/infer`: JSON, or JSON with binary tensor
    data after it (`Inference-Header-Content-Length`)."""

    runtime: Serving
    name: str
    model: KServeModel
    header_length: str | None
    limits: LimitsConfig
    output: str
    regions: SharedMemoryRegions
    inline: bool = False

    @property
    def tower(self) -> TowerKind:
        return self.model.tower

    @classmethod
    def of(cls, request: Request, pipeline: Pipeline[Any]) -> Infer:
        name, model = _model(request)
        # Content-Encoding: refused for every inference route before this (http/door.py).
        header_length = request.headers.get(codec.HEADER_LENGTH)
        limits, output = pipeline.config.limits, pipeline.names.output
        # The UINT8 model's binary request: a short JSON header and a view of the tensor, less
        # work than a hop to the pool. Any other is parsed there (JSON data, range checks,
        # reads from shared memory).
        content_length = request.headers.get("content-length")
        inline = model.datatype == "UINT8" and _inline(header_length, content_length)
        regions = pipeline.regions
        return cls(pipeline.runtime, name, model, header_length, limits, output, regions, inline)

    def parse(self, body: bytes) -> Work[codec.InferRequest]:
        parsed = codec.parse_infer_request(
            body,
            self.header_length,
            tower=self.tower,
            size=self.runtime.model.preprocess.size,
            max_items=self.limits.max_items_per_request,
            max_text_chars=self.limits.max_text_chars,
            output=self.output,
            truncate=self.limits.truncate_text,
            datatype=self.model.datatype,
            read_region=self.regions.read,
            max_shared_bytes=self.limits.max_body_bytes,
        )
        return work_of(parsed, self.tower, self.runtime, self.limits, self.regions.fits)

    def encode(self, work: Work[codec.InferRequest], done: Embedded) -> Encoded:
        completed = done.texts if self.tower == "text" else done.images
        assert completed is not None
        parsed = work.parsed
        content, headers, media = codec.encode_infer_response(
            completed.embeddings,
            model_name=self.name,
            request_id=parsed.id,
            outputs=parsed.outputs,
            write_region=self.regions.write,
        )
        return Encoded(content, media, headers)


async def server_metadata(request: Request) -> Response:
    return _json(codec.server_metadata())


async def live(request: Request) -> Response:
    """Like /healthz: false once a tower has no live worker (a lost device does not return)."""
    return _empty(health.liveness(pipeline_of(request).towers).ok)


async def ready(request: Request) -> Response:
    """Like /readyz: true while every worker of both towers is alive."""
    return _empty(pipeline_of(request).readiness().ok)


async def model_ready(request: Request) -> Response:
    _, model = _model(request)
    return _empty(health.tower_ready(pipeline_of(request).towers[model.tower]))


async def model_metadata(request: Request) -> Response:
    name, served = _model(request)
    pipeline = pipeline_of(request)
    model = pipeline.runtime.model
    size, dim, output = model.preprocess.size, model.embed_dim, pipeline.names.output
    return _json(codec.model_metadata(name, served, size, dim, output))


def serving_of(pipeline: Pipeline[Any]) -> triton_model.Serving:
    """What Triton's model configuration reports of this server (the resolved config)."""
    config, runtime = pipeline.config, pipeline.runtime
    model = runtime.model
    return triton_model.Serving(
        size=model.preprocess.size,
        embed_dim=model.embed_dim,
        output=pipeline.names.output,
        max_items=config.limits.max_items_per_request,
        max_batch_size=config.batching.max_batch_size,
        max_queue_delay_ms=config.batching.max_queue_delay_ms,
        devices=runtime.devices,
        backend=runtime.backend,
    )


async def model_config(request: Request) -> Response:
    """Triton's model configuration (perf_analyzer reads it first)."""
    name, model = _model(request)
    return _json(triton_model.config_json(name, model, serving_of(pipeline_of(request))))


async def statistics(request: Request) -> Response:
    """Triton's statistics: one model's (the path names it) or every model's."""
    pipeline = pipeline_of(request)
    if "name" in request.path_params:
        name, model = _model(request)
        models = [(name, model.tower)]
    else:
        models = [(n, m.tower) for n, m in pipeline.names.kserve_models().items()]
    return _json(stats.statistics_json(stats.model_statistics(pipeline.metrics, models)))


async def repository_index(request: Request) -> Response:
    """Triton's model repository index (`POST /v2/repository/index`): tritonclient's
    `get_model_repository_index` and perf_analyzer ask it which models are there."""
    pipeline = pipeline_of(request)
    ready = {kind: health.tower_ready(tower) for kind, tower in pipeline.towers.items()}
    models = {name: ready[m.tower] for name, m in pipeline.names.kserve_models().items()}
    return _json(codec.repository_index(models))


# What may follow a model's path: `.../{name}/infer` is always inference, never the metadata
# of a model named "{name}/infer", for every method.
ACTIONS = frozenset({"ready", "config", "stats", "infer"})


class MetadataRoute(Route):
    """`GET /v2/models/{name}[/versions/{version}]`, whose {name} may hold slashes, except on a
    path that ends in an action: there a method the action does not take (GET .../infer) is
    its 405 with Allow, not the metadata of an unknown model "{name}/infer"."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE and scope["path"].rpartition("/")[2] in ACTIONS:
            return Match.NONE, {}
        return match, child


class KServeDoor:
    error_prefixes = ("/v2",)

    def routes(self) -> Sequence[BaseRoute]:
        # A name may hold slashes, so the longest paths are matched first: a versioned path
        # before an unversioned one, and /ready and /infer before the bare metadata path.
        model = "/v2/models/{name:path}"
        version = model + "/versions/{version}"
        return [
            Route("/v2", server_metadata, methods=["GET"]),
            Route("/v2/health/live", live, methods=["GET"]),
            Route("/v2/health/ready", ready, methods=["GET"]),
            Route("/v2/repository/index", repository_index, methods=["POST"]),
            Route("/v2/models/stats", statistics, methods=["GET"]),
            *shared_memory_routes(),
            *(
                route
                for prefix in (version, model)
                for route in (
                    Route(prefix + "/ready", model_ready, methods=["GET"]),
                    Route(prefix + "/config", model_config, methods=["GET"]),
                    Route(prefix + "/stats", statistics, methods=["GET"]),
                    inference_route(prefix + "/infer", Infer.of),
                )
            ),
            MetadataRoute(version, model_metadata, methods=["GET"]),
            MetadataRoute(model, model_metadata, methods=["GET"]),
        ]

    def render_error(self, status: int, code: str, message: str) -> Response:
        """Triton's `{"error": "..."}`; tritonclient raises InferenceServerException with it."""
        status = 400 if status == 422 else status
        return Response(codec.encode_error(message), status, media_type=JSON)
